"""The task object: the stored spec plus what its trials say now (counts, progress, best trial, ETA).

Two queries for any number of tasks (their trials' progress columns, then their best trials), so a
list page costs the same as one task.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.schemas.tasks import BestTrial, TaskOut, TrialCounts
from common.models import Task, Trial, utcnow
from common.states import TASK_RUNNING, TRIAL_FINAL, TRIAL_STATES


@dataclass
class TrialSummary:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRIAL_STATES, 0))
    progress: float = 0.0


def summarise(trials: Iterable[tuple[str, int, int]]) -> TrialSummary:
    """From (state, steps_done, total_steps) rows: finished trials count fully, others by their steps."""
    summary = TrialSummary()
    done = 0.0
    n = 0
    for state, steps_done, total_steps in trials:
        n += 1
        summary.counts[state] = summary.counts.get(state, 0) + 1
        if state in TRIAL_FINAL:
            done += 1
        elif total_steps > 0:
            done += min(1.0, max(0.0, steps_done / total_steps))
    summary.progress = done / n if n else 0.0
    return summary


def seconds_left(task: Task, progress: float, now: datetime) -> float | None:
    """Elapsed x (1 - p) / p for a running task with some progress; None when there is nothing to go on."""
    if task.state != TASK_RUNNING or task.started_at is None or progress <= 0:
        return None
    started = task.started_at if task.started_at.tzinfo else task.started_at.replace(tzinfo=UTC)
    elapsed = max(0.0, (now - started).total_seconds())
    return round(elapsed * (1 - progress) / progress, 1)


def _task_out(task: Task, summary: TrialSummary, best: Trial | None, now: datetime) -> TaskOut:
    spec = task.spec
    counts = TrialCounts(**{k: v for k, v in summary.counts.items() if k in TrialCounts.model_fields})
    return TaskOut(
        id=task.id,
        state=task.state,
        base_model=task.base_model,
        training_file=task.training_file_id,
        validation_file=task.validation_file_id,
        validation_split=spec.get("validation_split"),
        strategy=spec["strategy"],
        search_space=spec["search_space"],
        max_trials=spec.get("max_trials"),
        epochs=spec.get("epochs"),
        max_steps=spec.get("max_steps"),
        max_seq_len=spec["max_seq_len"],
        eval_interval=spec["eval_interval"],
        early_exit=spec["early_exit"],
        seed=spec["seed"],
        training=spec.get("training", {}),
        scheduling=spec["scheduling"],
        trial_counts=counts,
        progress=round(summary.progress, 6),
        best_trial=None if best is None else BestTrial(
            id=best.id, hyperparameters=best.hyperparameters, best_val_loss=best.best_val_loss,
            best_step=best.best_step,
        ),
        estimated_seconds_left=seconds_left(task, summary.progress, now),
        error=task.error,
        created_at=task.created_at,
        started_at=task.started_at,
        finished_at=task.finished_at,
    )


def task_views(session: Session, tasks: Sequence[Task]) -> list[TaskOut]:
    if not tasks:
        return []
    ids = [t.id for t in tasks]
    rows: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    stmt = select(Trial.task_id, Trial.state, Trial.steps_done, Trial.total_steps).where(Trial.task_id.in_(ids))
    for task_id, state, steps_done, total_steps in session.execute(stmt):
        rows[task_id].append((state, steps_done, total_steps))
    # The final best trial once the task succeeded; until then, the lowest validation loss so far.
    best_ids = [t.best_trial_id for t in tasks if t.best_trial_id]
    best: dict[str, Trial] = {}
    for trial in session.scalars(select(Trial).where(Trial.id.in_(best_ids))) if best_ids else []:
        best[trial.task_id] = trial
    open_ids = [t.id for t in tasks if not t.best_trial_id]
    if open_ids:
        leaders = select(Trial).where(Trial.task_id.in_(open_ids), Trial.best_val_loss.is_not(None))
        for trial in session.scalars(leaders.order_by(Trial.best_val_loss.desc(), Trial.index.desc())):
            best[trial.task_id] = trial  # ascending by overwrite: the last one written is the lowest loss
    now = utcnow()
    return [_task_out(t, summarise(rows[t.id]), best.get(t.id), now) for t in tasks]


def task_view(session: Session, task: Task) -> TaskOut:
    return task_views(session, [task])[0]
