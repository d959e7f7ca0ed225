"""Adapter downloads: the trained PEFT adapter of a trial, as the worker stored it (`.tar.gz`).

A download already begun runs to its end even if its key is revoked (or its tenant deleted) meanwhile: it is one
finite object the key was allowed to read when the request was authorised, and cutting it would leave a truncated
archive without withholding anything the client had not been given. Every later request is a 401 at once. Only
the event stream, which is open-ended, re-checks its key while open (api/sse.py)."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi.responses import StreamingResponse

from api.errors import ApiError, conflict
from common.artifacts import get_artifact_store
from common.states import TASK_CANCELLED, TASK_FAILED, TASK_SUCCEEDED
from common.tables import Task, Trial

CHUNK_BYTES = 1 << 20


def _not_ready(message: str) -> ApiError:
    return conflict("adapter_not_ready", message)


def adapter_download(trial: Trial) -> StreamingResponse:
    """Streams the stored archive; 409 adapter_not_ready while there is none."""
    store = get_artifact_store()
    key = trial.adapter_key
    if not key or not store.exists(key):
        raise _not_ready(f"Trial '{trial.id}' has no adapter yet (state: {trial.state}).")
    handle = store.open(key)  # opened now, so a missing object is a 409 above, not a broken stream

    def chunks() -> Iterator[bytes]:
        with handle:
            while chunk := handle.read(CHUNK_BYTES):
                yield chunk

    filename = f"{trial.task_id}-{trial.id}-adapter.tar.gz"
    return StreamingResponse(
        chunks(),
        media_type="application/gzip",
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
