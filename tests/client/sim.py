"""Stand-ins for the scheduler and a worker, by direct database writes plus the scheduler's own
`finalize_tasks`: trials start, report points, end with a stored adapter archive; tasks get their result."""

from __future__ import annotations

import io
import json
import tarfile
import threading
import time
from collections.abc import Callable, Sequence

from tests.factories import trial_ids


def adapter_archive(rank: int) -> bytes:
    """A .tar.gz laid out as a worker stores it: the PEFT files at its root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in (("adapter_config.json", json.dumps({"r": rank, "peft_type": "LORA"}).encode()),
                           ("adapter_model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def finalize() -> None:
    from common.db import session_scope
    from common.tables import utcnow
    from scheduler.service.task_results import finalize_tasks

    with session_scope() as session:
        finalize_tasks(session, utcnow())


def start(task_id: str, steps_done: int = 1) -> list[str]:
    """Every trial runs (`trial.running`), `steps_done` steps in; the task becomes running."""
    from common.db import session_scope
    from common.events import record_event
    from common.tables import Trial

    ids = trial_ids(task_id)
    with session_scope() as session:
        for trial_id in ids:
            trial = session.get(Trial, trial_id)
            assert trial is not None
            trial.state, trial.steps_done, trial.last_train_loss = "running", steps_done, 6.0
            record_event(session, tenant_id=trial.tenant_id, task_id=task_id, trial_id=trial.id,
                         type="trial.running", message=f"trial {trial.index} placed on worker test")
    finalize()
    return ids


def finish(task_id: str, val_losses: Sequence[float | None], states: Sequence[str] | None = None,
           metric_scores: Sequence[float | None] | None = None) -> list[str]:
    """Trial i ends in states[i] (completed) with best validation loss val_losses[i], its train and
    validation points stored, and (when completed) its adapter; then the task gets its result.
    `metric_scores`: each trial's score on the task's generative metric (a "metric" point at its last step)."""
    from common.artifacts import adapter_key, get_artifact_store
    from common.db import session_scope
    from common.events import record_event
    from common.tables import MetricPoint, Trial

    ids = trial_ids(task_id)
    states = states or ["completed"] * len(ids)
    scores = metric_scores or [None] * len(ids)
    with session_scope() as session:
        for trial_id, val, state, score in zip(ids, val_losses, states, scores, strict=True):
            trial = session.get(Trial, trial_id)
            assert trial is not None
            n = trial.total_steps
            trial.state, trial.steps_done, trial.best_val_loss = state, n, val
            trial.best_step = n if val is not None else None
            trial.last_train_loss = None if val is None else val + 0.25
            if state == "failed":
                trial.error = "CUDA out of memory"
            session.add_all([MetricPoint(trial_id=trial.id, step=s, split="train", loss=7.0 - s / n)
                             for s in range(1, n + 1)])
            if val is not None:
                session.add(MetricPoint(trial_id=trial.id, step=n, split="val", loss=val))
            if score is not None:
                trial.metric_score = score
                session.add(MetricPoint(trial_id=trial.id, step=n, split="metric", loss=score))
            if state == "completed":
                key = adapter_key(task_id, trial.id)
                get_artifact_store().put_bytes(key, adapter_archive(trial.hyperparameters["lora_rank"]))
                trial.adapter_key = key
            record_event(session, tenant_id=trial.tenant_id, task_id=task_id, trial_id=trial.id,
                         type=f"trial.{state}", message=f"trial {trial.index} {state}")
    finalize()
    return ids


def later(delay_s: float, *steps: Callable[[], object]) -> threading.Thread:
    """Runs `steps` in a thread, `delay_s` apart (the first after `delay_s`): a task that runs while it is
    being followed."""

    def run() -> None:
        for step in steps:
            time.sleep(delay_s)
            step()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
