"""Trials of a task: their configurations, state, loss curves and adapters. A tenant's key reads its own; the
admin token any tenant's, each read written to the audit log (api/services/audit.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import select

from api.deps import ReaderDep, SessionDep
from api.queries import get_task, get_trial, list_trials
from api.schemas.common import INT32_MAX, ListPage, PathId, error_responses
from api.schemas.trials import LossPoint, MetricScore, TrialMetrics, TrialOut
from api.services.adapters import FORMAT_HELP, AdapterFormat, adapter_download, export_download
from api.services.audit import audit_read
from common.metrics import METRIC_SPLIT
from common.tables import MetricPoint

router = APIRouter(prefix="/tasks/{task_id}/trials", tags=["trials"], responses=error_responses(401, 403, 404, 422))


@router.get("")
def list_task_trials(task_id: PathId, reader: ReaderDep, session: SessionDep, request: Request) -> ListPage[TrialOut]:
    """All trials of the task, by index."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=task_id)
    page = ListPage(data=[TrialOut.of(t) for t in list_trials(session, tenant_id=reader.tenant_id, task_id=task.id)])
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return page


@router.get("/{trial_id}")
def read_trial(
    task_id: PathId, trial_id: PathId, reader: ReaderDep, session: SessionDep, request: Request
) -> TrialOut:
    trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task_id, trial_id=trial_id)
    out = TrialOut.of(trial)
    audit_read(session, reader, request, tenant_id=trial.tenant_id, resource_id=trial.id)
    return out


@router.get("/{trial_id}/metrics")
def read_trial_metrics(
    task_id: PathId,
    trial_id: PathId,
    reader: ReaderDep,
    session: SessionDep,
    request: Request,
    step_from: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    step_to: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
) -> TrialMetrics:
    """Train and validation loss by step, and the scores on the task's generative metric, optionally within
    [step_from, step_to]."""
    trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task_id, trial_id=trial_id)
    stmt = select(MetricPoint).where(MetricPoint.trial_id == trial.id)
    if step_from is not None:
        stmt = stmt.where(MetricPoint.step >= step_from)
    if step_to is not None:
        stmt = stmt.where(MetricPoint.step <= step_to)
    curves: dict[str, list[LossPoint]] = {"train": [], "val": []}
    scores: list[MetricScore] = []
    for point in session.scalars(stmt.order_by(MetricPoint.step)):
        if point.split == METRIC_SPLIT:
            scores.append(MetricScore(step=point.step, score=point.loss))
        else:
            curves.setdefault(point.split, []).append(LossPoint(step=point.step, loss=point.loss))
    metrics = TrialMetrics(trial_id=trial.id, train=curves["train"], val=curves["val"], metric=scores)
    audit_read(session, reader, request, tenant_id=trial.tenant_id, resource_id=trial.id)
    return metrics


@router.get(
    "/{trial_id}/adapter",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/gzip": {}, "application/octet-stream": {}}},
               202: {"description": "a merged model or GGUF adapter being built"},
               **error_responses(409)},
)
def download_trial_adapter(
    task_id: PathId, trial_id: PathId, reader: ReaderDep, session: SessionDep, request: Request,
    format: Annotated[AdapterFormat, Query(description=FORMAT_HELP)] = "peft",
) -> Response:
    """This trial's adapter (PEFT directory as .tar.gz), or with ?format=merged its base with the adapter merged in,
    with ?format=gguf the adapter as a llama.cpp LoRA GGUF (202 while a worker builds them); 409 adapter_not_ready
    until there is an adapter; 422 unsupported_format for gguf on an architecture without it."""
    trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task_id, trial_id=trial_id)
    if format != "peft":
        download = export_download(session, trial, get_task(session, tenant_id=reader.tenant_id, task_id=task_id),
                                   format, may_build=not reader.is_admin)
    else:
        download = adapter_download(trial)  # a 409 before the audit row: no adapter was read
    audit_read(session, reader, request, tenant_id=trial.tenant_id, resource_id=trial.id)
    return download
