"""A trial's adapter checkpoints: its adapter kept at each epoch's end, its best and its last step (the task's
`training.epoch_checkpoints` bounds the epoch ones), listed with their losses, downloadable in PEFT format and
sampled with `checkpoint` in a completion body, and deleted by their tenant (their bytes count in its storage
quota)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import StreamingResponse

from api.deps import ReaderDep, SessionDep, TenantDep
from api.queries import get_trial
from api.schemas.common import INT32_MAX, ListPage, PathId, error_responses
from api.schemas.trials import CheckpointDeleted, CheckpointOut
from api.services.adapters import checkpoint_download
from api.services.audit import audit_read
from api.services.checkpoints import checkpoint_metric, delete_checkpoint, get_checkpoint, trial_checkpoints

router = APIRouter(prefix="/tasks/{task_id}/trials/{trial_id}/checkpoints", tags=["trials"],
                   responses=error_responses(401, 403, 404, 422))

Step = Annotated[int, Path(ge=0, le=INT32_MAX, description="The checkpoint's step.")]


@router.get("")
def list_checkpoints(task_id: PathId, trial_id: PathId, reader: ReaderDep, session: SessionDep,
                     request: Request) -> ListPage[CheckpointOut]:
    """The trial's kept checkpoints, by step (none until its first epoch ends or its validation first improves)."""
    trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task_id, trial_id=trial_id)
    page = ListPage(data=[CheckpointOut.of(c, kinds, checkpoint_metric(trial, kinds))
                          for c, kinds in trial_checkpoints(session, trial)])
    audit_read(session, reader, request, tenant_id=trial.tenant_id, resource_id=trial.id)
    return page


@router.get("/{step}")
def read_checkpoint(task_id: PathId, trial_id: PathId, step: Step, reader: ReaderDep, session: SessionDep,
                    request: Request) -> CheckpointOut:
    trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task_id, trial_id=trial_id)
    found = get_checkpoint(session, trial, step)
    kinds = {c.step: k for c, k in trial_checkpoints(session, trial)}[found.step]
    out = CheckpointOut.of(found, kinds, checkpoint_metric(trial, kinds))
    audit_read(session, reader, request, tenant_id=trial.tenant_id, resource_id=trial.id)
    return out


@router.get("/{step}/adapter", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": {}}}, **error_responses(409)})
def download_checkpoint(task_id: PathId, trial_id: PathId, step: Step, reader: ReaderDep, session: SessionDep,
                        request: Request) -> StreamingResponse:
    """The checkpoint's adapter (PEFT directory as .tar); 409 checkpoint_gone if its trial dropped it since."""
    trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task_id, trial_id=trial_id)
    download = checkpoint_download(get_checkpoint(session, trial, step))
    audit_read(session, reader, request, tenant_id=trial.tenant_id, resource_id=trial.id)
    return download


@router.delete("/{step}")
def remove_checkpoint(task_id: PathId, trial_id: PathId, step: Step, tenant: TenantDep,
                      session: SessionDep) -> CheckpointDeleted:
    """Deletes the checkpoint (its archive and its row): its bytes no longer count in the tenant's storage quota. The
    trial's adapter (GET .../adapter) is not a checkpoint and stays."""
    trial = get_trial(session, tenant_id=tenant.id, task_id=task_id, trial_id=trial_id)
    delete_checkpoint(session, trial, step)
    return CheckpointDeleted(trial_id=trial.id, step=step)
