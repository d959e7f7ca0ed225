"""The base models tasks can tune (the registry)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from sqlalchemy import select

from api.deps import SessionDep, get_tenant
from api.errors import not_found
from api.schemas.common import ListPage, PathId, error_responses
from api.schemas.models import ModelOut
from common.models import BaseModelEntry

router = APIRouter(
    prefix="/models", tags=["models"], dependencies=[Depends(get_tenant)], responses=error_responses(401, 404)
)


@router.get("")
def list_models(session: SessionDep) -> ListPage[ModelOut]:
    entries = session.scalars(select(BaseModelEntry).order_by(BaseModelEntry.name))
    return ListPage(data=[ModelOut.of(m) for m in entries])


@router.get("/{name:path}")
def read_model(name: PathId, session: SessionDep) -> ModelOut:
    """`name` may contain slashes (hub-style ids such as `org/model`)."""
    entry = session.get(BaseModelEntry, name)
    if entry is None:
        raise not_found("model", name)
    return ModelOut.of(entry)
