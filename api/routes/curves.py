"""A task's loss curves, every trial at once, as JSONL (`loraplane replay` reads it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from api.deps import ReaderDep, SessionDep
from api.queries import get_task, list_trials
from api.schemas.common import INT32_MAX, PathId, error_responses
from api.services.audit import audit_read
from api.services.curves import curve_lines

router = APIRouter(prefix="/tasks/{task_id}/curves", tags=["curves"], responses=error_responses(401, 403, 404, 422))


@router.get(
    "",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}},
                     "description": "One JSON object per trial, by index (format: api/services/curves.py)."}},
)
def export_curves(
    task_id: PathId,
    reader: ReaderDep,
    session: SessionDep,
    request: Request,
    after_step: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="Only points past this step (every "
                                                                            "trial still has its line).")] = None,
) -> StreamingResponse:
    """Every trial's train and validation points with samples and tokens seen, one line per trial."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=task_id)
    trials = list_trials(session, tenant_id=reader.tenant_id, task_id=task.id)
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return StreamingResponse(
        curve_lines(task, trials, after_step),
        media_type="application/x-ndjson",
        headers={"Content-Disposition": f'attachment; filename="{task.id}-curves.jsonl"'},
    )
