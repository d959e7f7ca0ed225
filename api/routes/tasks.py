"""Tuning tasks of the calling tenant; the operator (admin token) reads any tenant's, each read audited."""

from __future__ import annotations

from typing import Annotated

import anyio
from anyio.lowlevel import RunVar
from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.db import bad_cursor, newest_first, session_factory
from api.deps import (
    ApiKeyDep,
    EgressDep,
    Reader,
    ReaderDep,
    SessionDep,
    TenantDep,
    hash_api_key,
    is_admin_token,
    operator_reader,
    tenant_id_for_key,
)
from api.errors import PERMISSION, ApiError, invalid, not_found
from api.queries import find_task, get_task, get_trial
from api.schemas.common import NO_CONTROL_CHARS, ListPage, PathId, error_responses, id_query
from api.schemas.tasks import TaskCreate, TaskOut
from api.services.adapters import FORMAT_HELP, AdapterFormat, adapter_download, export_download, no_best_trial, no_refit
from api.services.audit import audit_read
from api.services.task_views import draft_view, task_status, task_view, task_views
from api.services.tasks import cancel_task, create_task, dry_run_task
from common.db import get_autocommit_engine
from common.states import (
    TASK_CANCELLED,
    TASK_FAILED,
    TASK_QUEUED,
    TASK_RUNNING,
    TASK_SUCCEEDED,
    TASK_VALIDATING,
    TRIAL_FINAL,
)
from common.tables import Task, Tenant

router = APIRouter(prefix="/tasks", tags=["tasks"], responses=error_responses(401, 403, 404, 422))

TASK_STATES = (TASK_VALIDATING, TASK_QUEUED, TASK_RUNNING, TASK_SUCCEEDED, TASK_FAILED, TASK_CANCELLED)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={200: {"description": "An earlier task with the same Idempotency-Key, or a dry run's task."},
               **error_responses(429)},
)
def submit_task(
    body: TaskCreate,
    tenant: TenantDep,
    session: SessionDep,
    response: Response,
    egress: EgressDep,
    idempotency_key: Annotated[
        str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200, pattern=NO_CONTROL_CHARS)
    ] = None,
    dry_run: Annotated[bool, Query(description="Check everything a submission checks (the same errors) and answer "
                                   "200 with the task as it would be, id null, and its estimate; write nothing.")
                       ] = False,
) -> TaskOut:
    """Expand the search space into trials and queue them, with the task's `estimate` (tokens, GPU seconds, wall
    seconds) from the planner's cost model and the cluster now."""
    if dry_run:
        response.status_code = status.HTTP_200_OK
        draft = dry_run_task(session, tenant=tenant, body=body, idempotency_key=idempotency_key, egress=egress)
        return task_view(session, draft) if isinstance(draft, Task) else draft_view(draft.task, len(draft.configs))
    task, created = create_task(session, tenant=tenant, body=body, idempotency_key=idempotency_key, egress=egress)
    if not created:
        response.status_code = status.HTTP_200_OK
    return task_view(session, task)


def listed_tenant(session: SessionDep, reader: Reader, tenant_id: str | None) -> str | None:
    """The tenant whose tasks a list shows (None: every tenant's, the operator's default). A tenant sees its own
    only: naming another is a 403 `admin_only`; the operator naming a tenant that never existed gets a 404 (a
    deleted one's tasks are still listed: they are kept)."""
    if not reader.is_admin:
        if tenant_id is not None and tenant_id != reader.tenant_id:
            raise ApiError(403, PERMISSION, "admin_only", "Only the admin token lists another tenant's tasks.",
                           param="tenant_id")
        return reader.tenant_id
    if tenant_id is not None and session.get(Tenant, tenant_id) is None:
        raise not_found("tenant", tenant_id)
    return tenant_id


@router.get("")
def list_tasks(
    reader: ReaderDep,
    session: SessionDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, id_query("The id of the last task of the previous page.")] = None,
    state: Annotated[str | None, Query(description=f"One of {', '.join(TASK_STATES)}.")] = None,
    tenant_id: Annotated[str | None, id_query("The admin token only: one tenant's tasks (default: every tenant's)."
                                              )] = None,
) -> ListPage[TaskOut]:
    """This tenant's tasks, newest first; with the admin token, every tenant's (or `tenant_id`'s), audited."""
    if state is not None and state not in TASK_STATES:
        raise invalid(f"state must be one of {', '.join(TASK_STATES)}.", param="state")
    listed = listed_tenant(session, reader, tenant_id)
    cursor = None
    if after is not None and (cursor := find_task(session, tenant_id=listed, task_id=after)) is None:
        raise bad_cursor("task", after)
    stmt = select(Task) if listed is None else select(Task).where(Task.tenant_id == listed)
    if state is not None:
        stmt = stmt.where(Task.state == state)
    rows, has_more = newest_first(session, stmt, Task, after=cursor, limit=limit)
    page = ListPage(data=task_views(session, rows), has_more=has_more)
    audit_read(session, reader, request, tenant_id=listed, resource_id=None)
    return page


# Status reads of this process (of its event loop) run at most two at a time: one can wait on the database
# while the other runs; more threads only contend for the interpreter lock (with benchmarks/api_load.py's load,
# eight at once took ~20% more CPU a request than two). More processes (`--workers`) are what scale.
_STATUS_READS: RunVar[anyio.CapacityLimiter] = RunVar("status_reads")


def _status_reads() -> anyio.CapacityLimiter:
    try:
        return _STATUS_READS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(2)
        _STATUS_READS.set(limiter)
        return limiter


@router.get("/{task_id}")
async def read_task(task_id: PathId, key: ApiKeyDep, request: Request) -> TaskOut:
    """The task now: state, trial counts, progress, best trial so far, ETA (what clients poll)."""
    if is_admin_token(key):  # the operator's read of any tenant's task: audited, by the ordinary session path
        return await anyio.to_thread.run_sync(_read_task_as_operator, operator_reader(key), task_id, request,
                                              limiter=_status_reads())
    # The path clients poll: the key check and the reads run in one worker thread on one connection, rather
    # than a thread hop (and a handover of the interpreter lock) for the session, the tenant and the route each.
    return await anyio.to_thread.run_sync(_read_task, key, task_id, limiter=_status_reads())


def _read_task_as_operator(reader: Reader, task_id: str, request: Request) -> TaskOut:
    with session_factory()() as session:
        task = get_task(session, tenant_id=None, task_id=task_id)
        view = task_view(session, task)
        audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return view


def _read_task(key: str, task_id: str) -> TaskOut:
    with get_autocommit_engine().connect() as conn:
        task = task_status(conn, key_hash=hash_api_key(key), task_id=task_id)  # the key is checked in its join
        if task is None:
            tenant_id_for_key(conn, key)  # 401 if the key is the reason...
            raise not_found("task", task_id)  # ...else its tenant has no such task
    return task


@router.post("/{task_id}/cancel", responses=error_responses(409))
def cancel(task_id: PathId, tenant: TenantDep, session: SessionDep) -> TaskOut:
    """Cancel the task and its unfinished trials; 409 task_finished if it already finished. A tenant's key only:
    the admin token gets 403 `admin_read_only`."""
    return task_view(session, cancel_task(session, tenant=tenant, task_id=task_id))


@router.get(
    "/{task_id}/adapter",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/gzip": {}, "application/octet-stream": {}}},
               202: {"description": "a merged model or GGUF adapter being built"},
               **error_responses(409)},
)
def download_best_adapter(
    task_id: PathId, reader: ReaderDep, session: SessionDep, request: Request,
    refit: Annotated[bool, Query(description="The refit's adapter (a task submitted with \"refit\": true): the "
                                 "best configuration trained again on training + validation rows.")] = False,
    format: Annotated[AdapterFormat, Query(description=FORMAT_HELP)] = "peft",
) -> Response:
    """The best trial's adapter (PEFT directory as .tar.gz), or with ?refit=true its refit's; with ?format=merged the
    base with it merged in, with ?format=gguf a llama.cpp LoRA GGUF (202 while a worker builds them); 409
    adapter_not_ready until there is one, no_best_trial or
    no_refit when there will be none."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=task_id)
    if refit:
        if task.refit_trial_id is None:
            raise no_refit(task)
        trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task.id, trial_id=task.refit_trial_id)
        if trial.adapter_key is None and trial.state in TRIAL_FINAL:
            raise no_refit(task)
    else:
        if task.best_trial_id is None:
            raise no_best_trial(task)
        trial = get_trial(session, tenant_id=reader.tenant_id, task_id=task.id, trial_id=task.best_trial_id)
    # A 409 before the audit row: no adapter was read.
    # The admin token only reads: it is served what is built, and starts no build.
    download = (adapter_download(trial) if format == "peft"
                else export_download(session, trial, task, format, may_build=not reader.is_admin))
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return download
