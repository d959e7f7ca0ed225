"""The cluster at a glance (admin token): workers with their load, slots in use, who is waiting."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AdminDep, SessionDep
from api.schemas.cluster import ClusterOut
from api.schemas.common import error_responses
from api.services.cluster import cluster_view

router = APIRouter(
    prefix="/admin/cluster", tags=["admin"], dependencies=[AdminDep], responses=error_responses(401, 403)
)


@router.get("")
def read_cluster(session: SessionDep) -> ClusterOut:
    """Alive and lost workers, each with its live pack and occupied slots; utilisation = slots in use / slots of
    alive workers; pending and running trials per tenant."""
    return cluster_view(session)
