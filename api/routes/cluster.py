"""The cluster at a glance (admin token): workers with their load, slots in use, who is waiting."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.db import bad_cursor
from api.deps import AdminDep, SessionDep
from api.schemas.cluster import ClusterOut
from api.schemas.common import error_responses, id_query
from api.services.cluster import DEFAULT_WORKERS_SHOWN, MAX_WORKERS_SHOWN, cluster_view
from common.tables import Worker

router = APIRouter(
    prefix="/admin/cluster", tags=["admin"], dependencies=[AdminDep], responses=error_responses(401, 403, 422)
)


@router.get("")
def read_cluster(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=MAX_WORKERS_SHOWN, description="Workers in this page.")
                     ] = DEFAULT_WORKERS_SHOWN,
    after: Annotated[str | None, id_query("The id of the last worker of the previous page.")] = None,
) -> ClusterOut:
    """Alive and lost workers, each with its live packs and occupied slots, a page at a time (`has_more`,
    `workers_total`); utilisation = slots in use / slots of alive workers, over every worker; pending and running
    trials per tenant."""
    cursor = None
    if after is not None and (cursor := session.get(Worker, after)) is None:
        raise bad_cursor("worker", after)
    return cluster_view(session, limit=limit, after=cursor)
