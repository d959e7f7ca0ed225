"""The base models tasks can tune (the registry), as the calling tenant may use them."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from api.deps import SessionDep, TenantDep
from api.errors import not_found
from api.schemas.base_models import ModelOut
from api.schemas.common import ListPage, PathId, error_responses
from common.registry import may_use
from common.tables import BaseModelEntry

router = APIRouter(prefix="/models", tags=["models"], responses=error_responses(401, 404))


@router.get("")
def list_models(session: SessionDep, tenant: TenantDep) -> ListPage[ModelOut]:
    """The models this tenant may use (an entry restricted to other tenants, or retired, is left out)."""
    entries = session.scalars(
        select(BaseModelEntry).where(BaseModelEntry.deleted_at.is_(None)).order_by(BaseModelEntry.name))
    return ListPage(data=[ModelOut.of(m) for m in entries if may_use(m, tenant.id)])


@router.get("/{name:path}")
def read_model(name: PathId, session: SessionDep, tenant: TenantDep) -> ModelOut:
    """`name` may contain slashes (hub-style ids such as `org/model`). A model the tenant may not use, or a retired
    one, is a 404."""
    entry = session.get(BaseModelEntry, name)
    if entry is None or entry.deleted_at is not None or not may_use(entry, tenant.id):
        raise not_found("model", name)
    return ModelOut.of(entry)
