"""Adapter downloads: the trained PEFT adapter of a trial, as the worker stored it (`.tar.gz`).

A download already begun runs to its end even if its key is revoked (or its tenant deleted) meanwhile: it is one
finite object the key was allowed to read when the request was authorised, and cutting it would leave a truncated
archive without withholding anything the client had not been given. Every later request is a 401 at once. Only
the event stream, which is open-ended, re-checks its key while open (api/sse.py)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Literal, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.errors import UNAVAILABLE, ApiError, conflict, invalid
from common.architectures import export_formats
from common.artifacts import (
    LocalArtifactStore,
    export_claimed_key,
    export_failure_key,
    export_key,
    export_requested_key,
    get_artifact_store,
)
from common.celery import BUILD_EXPORT_TASK, exports_queue, get_celery
from common.export_builds import (
    NEVER_CLAIMED,
    WORKER_RESTARTED,
    WORKER_SILENT,
    BuildClaim,
    BuildRequest,
    WorkerSeen,
    resend_reason,
)
from common.messages import ExportRequest, ModelSourceFields
from common.registry import model_source_fields
from common.settings import get_settings
from common.states import TASK_CANCELLED, TASK_FAILED, TASK_SUCCEEDED, WORKER_ALIVE
from common.tables import BaseModelEntry, Checkpoint, Task, Trial, Worker, as_utc

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK_BYTES = 1 << 20
# `?format=`: the adapter as trained, merged into its base, or as a llama.cpp LoRA GGUF.
AdapterFormat = Literal["peft", "merged", "gguf"]
ExportFormat = Literal["merged", "gguf"]
FORMAT_HELP = ("peft: the adapter as trained (PEFT directory); merged: the base model with the adapter merged in (a "
               "Hugging Face safetensors directory); gguf: the adapter as a llama.cpp LoRA GGUF (llama, mistral, qwen2 "
               "and qwen3 bases). merged and gguf are built once on a worker: 202 until ready.")
EXPORT_RETRY_AFTER_S = 5  # what a 202 tells the client to wait before asking again


def _not_ready(message: str) -> ApiError:
    return conflict("adapter_not_ready", message)


def adapter_download(trial: Trial) -> StreamingResponse:
    """Streams the stored archive; 409 adapter_not_ready while there is none."""
    store = get_artifact_store()
    key = trial.adapter_key
    if not key or not store.exists(key):
        raise _not_ready(f"Trial '{trial.id}' has no adapter yet (state: {trial.state}).")
    return _stream(key, f"{trial.task_id}-{trial.id}-adapter.tar.gz")


# What each export is called in messages, its file's name and its media type.
EXPORTS = {"merged": ("The merged model", "merged.tar.gz", "application/gzip"),
           "gguf": ("The GGUF adapter", "adapter.gguf", "application/octet-stream")}


def export_download(session: Session, trial: Trial, task: Task, export_format: ExportFormat, *,
                    may_build: bool) -> Response:
    """The trial's export (worker/exports.py): ``merged``, its base with the adapter merged in (.tar.gz), or
    ``gguf``, its adapter as a llama.cpp LoRA GGUF, once built; until then 202 with how long to wait, the build asked
    of the workers on the first request, and again once the worker building it is gone (common/export_builds.py); 409
    export_failed once with the reason when a build failed (the next request tries again); 422 unsupported_format for
    a format the base's architecture has none of. ``may_build`` False (the admin token, which only reads): what is
    built is served, and nothing is asked of the workers nor changed in the store: 409 adapter_not_ready (or
    export_failed, kept for the tenant) instead of the 202."""
    what, filename, media_type = EXPORTS[export_format]
    entry = session.get(BaseModelEntry, task.base_model)
    architecture = entry.architecture if entry is not None else None
    formats = export_formats(architecture)
    if export_format not in formats:
        raise invalid(f"format: '{export_format}' is not built for {architecture} models (base model "
                      f"'{task.base_model}'); its adapters download as {' or '.join(formats)}.", param="format",
                      code="unsupported_format", formats=list(formats))
    store = get_artifact_store()
    if not trial.adapter_key or not store.exists(trial.adapter_key):
        raise _not_ready(f"Trial '{trial.id}' has no adapter yet (state: {trial.state}), so nothing to export.")
    key, failure_key = (export_key(task.id, trial.id, export_format),
                        export_failure_key(task.id, trial.id, export_format))
    if store.exists(key):
        return _stream(key, f"{trial.task_id}-{trial.id}-{filename}", media_type)
    requested_key = export_requested_key(task.id, trial.id, export_format)
    claimed_key = export_claimed_key(task.id, trial.id, export_format)
    failure = _read(store, failure_key)
    if failure is not None:
        error = _failure_error(failure)
        if may_build:  # reported once: the tenant's next request builds again
            for stale in (failure_key, requested_key, claimed_key):
                store.delete(stale)
        raise conflict("export_failed", f"{what} of trial '{trial.id}' could not be built ({error}). "
                                        "Ask again to try once more.")
    request = _parsed(_read(store, requested_key), BuildRequest.from_json)
    if not may_build:
        under_way = "a build is under way; " if request is not None else ""
        raise _not_ready(f"{what} of trial '{trial.id}' is not built ({under_way}the admin token only reads: a build "
                         "starts on the tenant's own request).")
    claim = _parsed(_read(store, claimed_key), BuildClaim.from_json)
    reason = resend_reason(request, claim, _worker_seen(session, claim), newest_beat=_newest_beat(session),
                           now=time.time(), timeout_s=get_settings().worker_timeout_s)
    if reason is not None:
        if entry is None:
            raise conflict("export_failed", f"Task '{task.id}''s base model '{task.base_model}' is no longer "
                                            "registered, so its adapters cannot be exported.")
        lost_worker = claim.worker_id if reason in (WORKER_RESTARTED, WORKER_SILENT) and claim is not None else None
        request = BuildRequest.new(time.time(), resent=reason or None, lost_worker=lost_worker)
        if reason:
            log.warning("the %s export of trial %s is asked for again (%s%s)", export_format, trial.id, reason,
                        f": worker {lost_worker}" if lost_worker else "")
        message = ExportRequest(task_id=task.id, trial_id=trial.id, adapter_key=trial.adapter_key,
                                base_model=ModelSourceFields.model_validate(model_source_fields(entry)),
                                format=export_format, request_id=request.request_id)
        try:
            get_celery().send_task(BUILD_EXPORT_TASK, kwargs={"request": message.to_dict()},
                                   queue=exports_queue(get_settings()))
        except Exception as exc:  # the broker is away: no build asked, none recorded; the client asks again
            raise ApiError(503, UNAVAILABLE, "broker_unavailable", f"The workers' queue cannot be reached to build "
                           f"{what[0].lower()}{what[1:]}; try again shortly.", headers={"Retry-After": "30"}) from exc
        # Two polls at once may both send: the build is stored once (a worker finds it built and stops), and the
        # marker names the later request, whose claim is the one watched.
        store.put_bytes(requested_key, request.to_json())
    assert request is not None
    return JSONResponse(status_code=202, headers={"Retry-After": str(EXPORT_RETRY_AFTER_S)},
                        content=_building(what, trial.id, request))


def _building(what: str, trial_id: str, request: BuildRequest) -> dict[str, object]:
    """The 202's body: being built, and whether the build was sent again and why (a worker lost with it)."""
    again = ""
    if request.resent in (WORKER_RESTARTED, WORKER_SILENT):
        again = (f" It was asked for again: worker '{request.lost_worker}', which was building it, "
                 f"{'restarted' if request.resent == WORKER_RESTARTED else 'stopped answering'}.")
    elif request.resent == NEVER_CLAIMED:
        again = " It was asked for again: no worker had taken the first request."
    return {"status": "building", "retry_after_s": EXPORT_RETRY_AFTER_S, "resent": request.resent,
            "lost_worker": request.lost_worker,
            "message": f"{what} of trial '{trial_id}' is being built by a worker; ask again in "
                       f"{EXPORT_RETRY_AFTER_S} s.{again}"}


def _read(store: LocalArtifactStore, key: str) -> bytes | None:
    """A marker's bytes, None when there is none (another request may delete it between a check and a read)."""
    try:
        return store.get_bytes(key)
    except FileNotFoundError:
        return None


def _parsed(raw: bytes | None, parse: Callable[[bytes], T | None]) -> T | None:
    return None if raw is None else parse(raw)


def _failure_error(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("error", "unknown"))
    except (ValueError, AttributeError):
        return "unknown"


def _worker_seen(session: Session, claim: BuildClaim | None) -> WorkerSeen | None:
    """What the scheduler last heard of the worker that claimed the build."""
    worker = session.get(Worker, claim.worker_id) if claim is not None else None
    if worker is None:
        return None
    started = worker.incarnation_started_at
    return WorkerSeen(incarnation=worker.incarnation,
                      incarnation_started_at=as_utc(started).timestamp() if started is not None else None,
                      last_heartbeat=as_utc(worker.last_heartbeat).timestamp(), alive=worker.state == WORKER_ALIVE)


def _newest_beat(session: Session) -> float | None:
    """The newest beat of any live worker (Unix seconds): whether workers' beats are being heard at all."""
    newest = session.scalar(select(func.max(Worker.last_heartbeat)).where(Worker.state == WORKER_ALIVE))
    return as_utc(newest).timestamp() if newest is not None else None


def checkpoint_download(checkpoint: Checkpoint) -> StreamingResponse:
    """A kept checkpoint's adapter (PEFT directory as .tar); 409 checkpoint_gone when its trial dropped it between
    the listing and the download (a newer one replaced it)."""
    if not get_artifact_store().exists(checkpoint.adapter_key):
        raise conflict("checkpoint_gone", f"The checkpoint at step {checkpoint.step} of trial "
                                          f"'{checkpoint.trial_id}' is no longer kept; list the checkpoints again.")
    return _stream(checkpoint.adapter_key, f"{checkpoint.task_id}-{checkpoint.trial_id}-step-{checkpoint.step}.tar",
                   "application/x-tar")


def _stream(key: str, filename: str, media_type: str = "application/gzip") -> StreamingResponse:
    handle = get_artifact_store().open(key)  # opened now, so a missing object is a 409 above, not a broken stream

    def chunks() -> Iterator[bytes]:
        with handle:
            while chunk := handle.read(CHUNK_BYTES):
                yield chunk

    return StreamingResponse(
        chunks(),
        media_type=media_type,
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


def no_best_trial(task: Task) -> ApiError:
    """409 for a task without a best trial: `adapter_not_ready` while it may still get one; `no_best_trial` once it
    ended without one, saying why (a failed task's reason), so nobody waits for an adapter that will not come."""
    if task.state == TASK_FAILED:
        reason = f": {task.error}" if task.error else ""
        return conflict("no_best_trial", f"Task '{task.id}' failed with no completed trial, so there is no adapter "
                                         f"to download{reason}")
    if task.state in (TASK_CANCELLED, TASK_SUCCEEDED):
        return conflict("no_best_trial", f"Task '{task.id}' ended ({task.state}) with no completed trial, so there "
                                         "is no adapter to download.")
    return _not_ready(f"Task '{task.id}' has no best trial yet (state: {task.state}), so no adapter to download.")


def no_refit(task: Task) -> ApiError:
    """409 for ``?refit=true`` on a task without a refit adapter: `no_refit` when it did not ask for one, or ended
    without its refit starting or completing; `adapter_not_ready` while one may still come."""
    if not task.parsed_spec.refit:
        return conflict("no_refit", f"Task '{task.id}' was not submitted with \"refit\": true, so it has no refit "
                                    "adapter; GET .../adapter without ?refit gives its best trial's.")
    if task.state in (TASK_FAILED, TASK_CANCELLED, TASK_SUCCEEDED):
        return conflict("no_refit", f"Task '{task.id}' ended ({task.state}) without a completed refit, so there is "
                                    "no refit adapter to download" + (
                                        "; its best trial's adapter is at GET .../adapter." if task.best_trial_id
                                        else "."))
    return _not_ready(f"Task '{task.id}' has no refit adapter yet (state: {task.state}): its refit starts once its "
                      "search ends.")
