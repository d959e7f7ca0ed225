"""A task's experiment trackers (its `integrations`): each trial's run there and whether it is in step."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.deps import ReaderDep, SessionDep
from api.queries import get_task
from api.schemas.common import ListPage, PathId, error_responses
from api.schemas.integrations import TrackerOut
from api.services.audit import audit_read
from api.services.trackers import tracker_states

router = APIRouter(prefix="/tasks/{task_id}/integrations", tags=["tasks"], responses=error_responses(401, 404, 422))


@router.get("")
def list_integrations(task_id: PathId, reader: ReaderDep, session: SessionDep,
                      request: Request) -> ListPage[TrackerOut]:
    """The task's trackers (without their tokens) and each trial's run in them: its id there, whether its end is
    logged, and why the tracker is behind while it is."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=task_id)
    page = ListPage(data=[TrackerOut.model_validate(t) for t in tracker_states(session, task)])
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return page
