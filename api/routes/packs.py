"""Packs (admin token): what each worker trains, slot by slot."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select

from api.deps import AdminDep, SessionDep
from api.errors import invalid, not_found
from api.schemas.cluster import PackOut
from api.schemas.common import ListPage, PathId, error_responses
from api.services.cluster import pack_views
from common.states import (
    PACK_DISPATCHED,
    PACK_FINISHED,
    PACK_LIVE,
    PACK_LOST,
    PACK_PLANNED,
    PACK_REFUSED,
    PACK_RUNNING,
)
from common.tables import Pack

router = APIRouter(
    prefix="/admin/packs", tags=["admin"], dependencies=[AdminDep], responses=error_responses(401, 403, 404, 422)
)

PACK_STATES = (PACK_PLANNED, PACK_DISPATCHED, PACK_RUNNING, PACK_FINISHED, PACK_LOST, PACK_REFUSED)
STATE_FILTERS = ("live", "all", *PACK_STATES)


@router.get("")
def list_packs(
    session: SessionDep,
    state: Annotated[str, Query(description=f"One of {', '.join(STATE_FILTERS)}; live = planned, dispatched "
                                            "or running.")] = "live",
    limit: Annotated[int, Query(ge=1, le=100)] = 50,
) -> ListPage[PackOut]:
    """Packs newest first, each with the trials that hold its slots now, its measured speed and, once ended,
    its profile (without the per-step samples: GET /v1/admin/packs/{id} has them)."""
    if state not in STATE_FILTERS:
        raise invalid(f"state must be one of {', '.join(STATE_FILTERS)}.", param="state")
    stmt = select(Pack)
    if state == "live":
        stmt = stmt.where(Pack.state.in_(PACK_LIVE))
    elif state != "all":
        stmt = stmt.where(Pack.state == state)
    rows = session.scalars(stmt.order_by(Pack.created_at.desc(), Pack.id.desc()).limit(limit + 1)).all()
    return ListPage(data=pack_views(session, rows[:limit]), has_more=len(rows) > limit)


@router.get("/{pack_id}")
def read_pack(pack_id: PathId, session: SessionDep) -> PackOut:
    """A pack as in the list, its profile with every per-step sample: where its wall time went (load, capture,
    steps, validation, metric, snapshot, persist, export, idle, other), its speed and its peak memory."""
    pack = session.get(Pack, pack_id)
    if pack is None:
        raise not_found("pack", pack_id)
    return pack_views(session, [pack], samples=True)[0]
