"""Adapter downloads: the trained PEFT adapter of a trial, as the worker stored it (`.tar.gz`).

A download already begun runs to its end even if its key is revoked (or its tenant deleted) meanwhile: it is one
finite object the key was allowed to read when the request was authorised, and cutting it would leave a truncated
archive without withholding anything the client had not been given. Every later request is a 401 at once. Only
the event stream, which is open-ended, re-checks its key while open (api/sse.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.orm import Session

from api.errors import UNAVAILABLE, ApiError, conflict, invalid
from common.architectures import export_formats
from common.artifacts import export_failure_key, export_key, export_requested_key, get_artifact_store
from common.celery import BUILD_EXPORT_TASK, exports_queue, get_celery
from common.messages import ExportRequest, ModelSourceFields
from common.registry import model_source_fields
from common.settings import get_settings
from common.states import TASK_CANCELLED, TASK_FAILED, TASK_SUCCEEDED
from common.tables import BaseModelEntry, Checkpoint, Task, Trial

CHUNK_BYTES = 1 << 20
# `?format=`: the adapter as trained, merged into its base, or as a llama.cpp LoRA GGUF.
AdapterFormat = Literal["peft", "merged", "gguf"]
ExportFormat = Literal["merged", "gguf"]
FORMAT_HELP = ("peft: the adapter as trained (PEFT directory); merged: the base model with the adapter merged in (a "
               "Hugging Face safetensors directory); gguf: the adapter as a llama.cpp LoRA GGUF (llama, mistral, qwen2 "
               "and qwen3 bases). merged and gguf are built once on a worker: 202 until ready.")
EXPORT_RETRY_AFTER_S = 5  # what a 202 tells the client to wait before asking again
EXPORT_RESEND_S = 900.0  # a build asked for this long ago and neither stored nor failed is asked for again


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


def export_download(session: Session, trial: Trial, task: Task, export_format: ExportFormat) -> Response:
    """The trial's export (worker/exports.py): ``merged``, its base with the adapter merged in (.tar.gz), or
    ``gguf``, its adapter as a llama.cpp LoRA GGUF, once built; until then 202 with how long to wait, the build asked
    of the workers on the first request (and again if it went missing); 409 export_failed once with the reason when a
    build failed (the next request tries again); 422 unsupported_format for a format the base's architecture has
    none of."""
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
    if store.exists(failure_key):
        error = json.loads(store.get_bytes(failure_key)).get("error", "unknown")
        store.delete(failure_key)
        store.delete(requested_key)
        raise conflict("export_failed", f"{what} of trial '{trial.id}' could not be built ({error}). "
                                        "Ask again to try once more.")
    asked_at = json.loads(store.get_bytes(requested_key))["at"] if store.exists(requested_key) else None
    if asked_at is None or time.time() - float(asked_at) > EXPORT_RESEND_S:
        if entry is None:
            raise conflict("export_failed", f"Task '{task.id}''s base model '{task.base_model}' is no longer "
                                            "registered, so its adapters cannot be exported.")
        request = ExportRequest(task_id=task.id, trial_id=trial.id, adapter_key=trial.adapter_key,
                                base_model=ModelSourceFields.model_validate(model_source_fields(entry)),
                                format=export_format)
        try:
            get_celery().send_task(BUILD_EXPORT_TASK, kwargs={"request": request.to_dict()},
                                   queue=exports_queue(get_settings()))
        except Exception as exc:  # the broker is away: no build asked, none recorded; the client asks again
            raise ApiError(503, UNAVAILABLE, "broker_unavailable", f"The workers' queue cannot be reached to build "
                           f"{what[0].lower()}{what[1:]}; try again shortly.", headers={"Retry-After": "30"}) from exc
        store.put_bytes(requested_key, json.dumps({"at": time.time()}).encode())
    return JSONResponse(
        status_code=202, headers={"Retry-After": str(EXPORT_RETRY_AFTER_S)},
        content={"status": "building", "retry_after_s": EXPORT_RETRY_AFTER_S,
                 "message": f"{what} of trial '{trial.id}' is being built by a worker; ask again in "
                            f"{EXPORT_RETRY_AFTER_S} s."})


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
