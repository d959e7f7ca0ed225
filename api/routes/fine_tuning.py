"""`/v1/fine_tuning/jobs`: OpenAI's fine-tuning API over tasks (issue 38), for the official `openai` client and code
written for it. Each route runs the task's own service (api/services/tasks.py, task_views.py, checkpoints.py) and maps
its result (api/services/fine_tuning.py): a job is checked, estimated, trained, isolated by tenant and cancelled as a
task is, and its errors come in the one error shape, which OpenAI's client reads as its own exceptions."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.db import bad_cursor, newest_first
from api.deps import EgressDep, ReaderDep, SessionDep, TenantDep
from api.queries import find_task, get_task
from api.schemas.common import ListPage, PathId, error_responses, id_query
from api.schemas.events import EventOut
from api.schemas.fine_tuning import FineTuningJob, JobCheckpoint, JobCreate, JobEvent
from api.schemas.tasks import TaskCreate
from api.schemas.trials import CheckpointOut
from api.services.audit import audit_read
from api.services.checkpoints import checkpoint_metric, trial_checkpoints
from api.services.fine_tuning import event_cursor, job_checkpoint, job_event, job_of, task_body
from api.services.task_views import task_view, task_views
from api.services.tasks import cancel_task, create_task, usable_model
from common.tables import BaseModelEntry, Event, Task, Trial

router = APIRouter(prefix="/fine_tuning/jobs", tags=["fine_tuning"], responses=error_responses(401, 403, 404, 422))


def _parameters(session: Session, model: str) -> int | None:
    entry = session.get(BaseModelEntry, model)
    return entry.parameters if entry is not None else None


def _job(session: Session, task: Task) -> FineTuningJob:
    return job_of(task_view(session, task), _parameters(session, task.base_model), time.time())


@router.post("", status_code=status.HTTP_200_OK, responses=error_responses(429))
def create_job(body: JobCreate, tenant: TenantDep, session: SessionDep, egress: EgressDep) -> FineTuningJob:
    """Create a job: its task, with one trial, or one per combination where a hyperparameter is a list."""
    model = usable_model(session, tenant, body.model)
    try:
        request = TaskCreate.model_validate(task_body(body, model.parameters))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    task, _ = create_task(session, tenant=tenant, body=request, egress=egress)
    return _job(session, task)


@router.get("")
def list_jobs(reader: ReaderDep, session: SessionDep, request: Request,
              after: Annotated[str | None, id_query("The id of the last job of the previous page.")] = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListPage[FineTuningJob]:
    """This tenant's jobs (its tasks), newest first."""
    cursor = None
    if after is not None and (cursor := find_task(session, tenant_id=reader.tenant_id, task_id=after)) is None:
        raise bad_cursor("job", after)
    stmt = select(Task) if reader.tenant_id is None else select(Task).where(Task.tenant_id == reader.tenant_id)
    rows, has_more = newest_first(session, stmt, Task, after=cursor, limit=limit)
    parameters = {name: _parameters(session, name) for name in {t.base_model for t in rows}}
    now = time.time()
    page = ListPage(data=[job_of(view, parameters[view.base_model], now) for view in task_views(session, rows)],
                    has_more=has_more)
    audit_read(session, reader, request, tenant_id=reader.tenant_id, resource_id=None)
    return page


@router.get("/{job_id}")
def retrieve_job(job_id: PathId, reader: ReaderDep, session: SessionDep, request: Request) -> FineTuningJob:
    task = get_task(session, tenant_id=reader.tenant_id, task_id=job_id)
    job = _job(session, task)
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return job


@router.post("/{job_id}/cancel", responses=error_responses(409))
def cancel_job(job_id: PathId, tenant: TenantDep, session: SessionDep) -> FineTuningJob:
    """Cancel the job's task and its unfinished trials; 409 task_finished if it already finished."""
    return _job(session, cancel_task(session, tenant=tenant, task_id=job_id))


@router.get("/{job_id}/events")
def list_job_events(job_id: PathId, reader: ReaderDep, session: SessionDep, request: Request,
                    after: Annotated[str | None, Query(max_length=30, description="The id of the last event of the "
                                                       "previous page (ftevent-<n>).")] = None,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> ListPage[JobEvent]:
    """The job's events, newest first, as OpenAI lists them (`after`: older than that event)."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=job_id)
    stmt = select(Event).where(Event.task_id == task.id, Event.tenant_id == task.tenant_id)
    if (before := event_cursor(after)) is not None:
        stmt = stmt.where(Event.id < before)
    rows = session.scalars(stmt.order_by(Event.id.desc()).limit(limit + 1)).all()
    page = ListPage(data=[job_event(EventOut.of(e)) for e in rows[:limit]], has_more=len(rows) > limit)
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return page


@router.get("/{job_id}/checkpoints")
def list_job_checkpoints(job_id: PathId, reader: ReaderDep, session: SessionDep, request: Request,
                         after: Annotated[str | None, Query(max_length=200)] = None,
                         limit: Annotated[int, Query(ge=1, le=100)] = 10) -> ListPage[JobCheckpoint]:
    """The kept checkpoints of the job's best trial (so far), newest first; each names the `model` that samples it."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=job_id)
    trial = session.get(Trial, task.best_trial_id) if task.best_trial_id else None
    kept = [CheckpointOut.of(c, kinds, checkpoint_metric(trial, kinds))
            for c, kinds in trial_checkpoints(session, trial)] if trial is not None else []
    checkpoints = [job_checkpoint(c) for c in reversed(kept)]
    if after is not None:
        ids = [c.id for c in checkpoints]
        checkpoints = checkpoints[ids.index(after) + 1:] if after in ids else []
    page = ListPage(data=checkpoints[:limit], has_more=len(checkpoints) > limit)
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return page
