"""`/v1/fine-tunes`: Together AI's fine-tuning API over tasks, for the official `together` client (3.1) and code
written for it. Each route runs the task's own service (api/services/tasks.py, task_views.py, checkpoints.py) and maps
its result (api/services/together.py): a fine-tune is checked, estimated, trained, isolated by tenant and cancelled as
a task is, and its errors come in the one error shape, which Together's client raises as its own exceptions.

Not served: file upload through Together's client (its presigned-URL flow; upload with POST /v1/files), delete,
content (download: GET /v1/tasks/{id}/adapter), metrics, preview and the tokenized dataset."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.deps import EgressDep, ReaderDep, SessionDep, TenantDep
from api.queries import get_task
from api.schemas.common import PathId, error_responses
from api.schemas.events import EventOut
from api.schemas.tasks import MAX_MAX_SEQ_LEN, MIN_MAX_SEQ_LEN, TaskCreate
from api.schemas.together import (
    FineTune,
    FineTuneCheckpointList,
    FineTuneCreate,
    FineTuneEvent,
    FineTuneEventList,
    FineTuneList,
    LoraLimits,
    ModelLimits,
    PriceEstimate,
)
from api.schemas.trials import CheckpointOut
from api.services.audit import audit_read
from api.services.checkpoints import checkpoint_metric, trial_checkpoints
from api.services.task_views import task_view, task_views
from api.services.tasks import cancel_task, create_task, usable_model
from api.services.together import fine_tune_checkpoint, fine_tune_event, fine_tune_of, task_body, together_loc
from common.architectures import ALL_TARGET_MODULES, target_modules_for
from common.tables import Event, Task, Trial

router = APIRouter(prefix="/fine-tunes", tags=["together"], responses=error_responses(401, 403, 404, 422))

EVENTS_SHOWN = 1000


def _events(session: Session, task: Task, limit: int) -> list[FineTuneEvent]:
    """The task's newest ``limit`` events, oldest first, as Together lists them."""
    stmt = select(Event).where(Event.task_id == task.id, Event.tenant_id == task.tenant_id)
    rows = session.scalars(stmt.order_by(Event.id.desc()).limit(limit)).all()
    return [fine_tune_event(EventOut.of(e)) for e in reversed(rows)]


@router.get("/models/limits")
def model_limits(tenant: TenantDep, session: SessionDep,
                 model_name: Annotated[str, Query(min_length=1, max_length=100)]) -> ModelLimits:
    """A base model's limits, which the client reads before it creates a fine-tune."""
    model = usable_model(session, tenant, model_name)
    seq = min(MAX_MAX_SEQ_LEN, model.max_context or MAX_MAX_SEQ_LEN)
    return ModelLimits(
        model_name=model.name, lora_training=LoraLimits(
            default_rank=8, max_batch_size=1024, max_batch_size_dpo=1024, max_rank=256, min_batch_size=1,
            target_modules=list(target_modules_for(model.architecture) or ALL_TARGET_MODULES)),
        max_learning_rate=1.0, min_learning_rate=0.0, max_num_checkpoints=100, max_num_epochs=100,
        max_num_evals=100, max_seq_length_sft=seq, max_seq_length_dpo=seq, min_max_seq_length=MIN_MAX_SEQ_LEN)


# Left out of the OpenAPI document: its path is also GET /fine-tunes/{id}'s (Together's API's own overlap), so its
# Allow header names a method the document cannot list for it; it is a stub the client calls, not a resource.
@router.post("/estimate-price", include_in_schema=False)
def estimate_price(_tenant: TenantDep) -> PriceEstimate:
    """loraplane prices nothing: the client skips its check (a task's estimate: GET /v1/tasks/{id})."""
    return PriceEstimate()


@router.post("", responses=error_responses(429))
def create_fine_tune(body: FineTuneCreate, tenant: TenantDep, session: SessionDep, egress: EgressDep) -> FineTune:
    """Create a fine-tune: its task, with one trial, or one per combination where a hyperparameter is a list."""
    try:
        request = TaskCreate.model_validate(task_body(body))
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": together_loc(tuple(e["loc"]))} for e in exc.errors()]) from None
    task, _ = create_task(session, tenant=tenant, body=request, egress=egress)
    return fine_tune_of(task_view(session, task))


@router.get("")
def list_fine_tunes(reader: ReaderDep, session: SessionDep, request: Request,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 1000) -> FineTuneList:
    """This tenant's fine-tunes (its tasks), newest first: the newest ``limit`` (Together's client pages nothing)."""
    stmt = select(Task) if reader.tenant_id is None else select(Task).where(Task.tenant_id == reader.tenant_id)
    rows = session.scalars(stmt.order_by(Task.created_at.desc(), Task.id.desc()).limit(limit)).all()
    page = FineTuneList(data=[fine_tune_of(view) for view in task_views(session, rows)])
    audit_read(session, reader, request, tenant_id=reader.tenant_id, resource_id=None)
    return page


@router.get("/{fine_tune_id}")
def retrieve_fine_tune(fine_tune_id: PathId, reader: ReaderDep, session: SessionDep, request: Request) -> FineTune:
    """The fine-tune, with its newest 1000 events."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=fine_tune_id)
    fine_tune = fine_tune_of(task_view(session, task), _events(session, task, EVENTS_SHOWN))
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return fine_tune


@router.post("/{fine_tune_id}/cancel", responses=error_responses(409))
def cancel_fine_tune(fine_tune_id: PathId, tenant: TenantDep, session: SessionDep) -> FineTune:
    """Cancel the fine-tune's task and its unfinished trials; 409 task_finished if it already finished."""
    return fine_tune_of(task_view(session, cancel_task(session, tenant=tenant, task_id=fine_tune_id)))


@router.get("/{fine_tune_id}/events")
def list_fine_tune_events(fine_tune_id: PathId, reader: ReaderDep, session: SessionDep, request: Request,
                          limit: Annotated[int, Query(ge=1, le=10_000)] = EVENTS_SHOWN) -> FineTuneEventList:
    """The fine-tune's newest ``limit`` events, oldest first."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=fine_tune_id)
    page = FineTuneEventList(data=_events(session, task, limit))
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return page


@router.get("/{fine_tune_id}/checkpoints")
def list_fine_tune_checkpoints(fine_tune_id: PathId, reader: ReaderDep, session: SessionDep,
                               request: Request) -> FineTuneCheckpointList:
    """The kept checkpoints of the fine-tune's best trial (so far), newest first; each `path` the `model` that
    samples it."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=fine_tune_id)
    trial = session.get(Trial, task.best_trial_id) if task.best_trial_id else None
    kept = [CheckpointOut.of(c, kinds, checkpoint_metric(trial, kinds))
            for c, kinds in trial_checkpoints(session, trial)] if trial is not None else []
    page = FineTuneCheckpointList(data=[fine_tune_checkpoint(c) for c in reversed(kept)])
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return page
