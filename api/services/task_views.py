"""The task object: the stored spec plus what its trials say now (counts, progress, best trial, ETA).

Never a row per trial: the counts and the progress come from an aggregate (a row per task and trial state),
the best trial from a query of a few columns that is skipped while no trial has a validation loss. A page of
tasks costs two queries whatever its length; a status poll (`task_status`, the path clients poll) one, with
the key check and the task in the same statement, and the best trial's when there is one. The statements are
built once, with bound parameters, and run as Core (rows, no ORM objects): building them and loading ORM
objects cost more than the queries themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Connection, Float, and_, bindparam, case, cast, func, or_, select
from sqlalchemy.orm import Session

from api.deps import VALID_KEY
from api.schemas.tasks import BestTrial, TaskEstimate, TaskOut, TaskWaiting, TrialCounts
from common.metrics import RankKey, rank_key, ranked_val_loss
from common.states import TASK_RUNNING, TRIAL_FINAL, TRIAL_PENDING, TRIAL_STATES
from common.tables import ApiKey, Task, Trial, as_utc, utcnow
from common.task_spec import LOSS, TaskSpec


class TaskFields(Protocol):
    """What a task object is made of: a `Task` (lists, submissions) or a row of `_TASK_STATUS` (status polls)."""

    @property
    def id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def base_model(self) -> str: ...
    @property
    def training_file_id(self) -> str: ...
    @property
    def validation_file_id(self) -> str | None: ...
    @property
    def spec(self) -> dict[str, Any]: ...
    @property
    def best_trial_id(self) -> str | None: ...
    @property
    def refit_trial_id(self) -> str | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def finished_at(self) -> datetime | None: ...
    @property
    def estimate(self) -> dict[str, Any] | None: ...
    @property
    def waiting(self) -> dict[str, Any] | None: ...


# How much of a trial is done: a finished one fully, others by their steps (clamped to [0, 1]).
_DONE_FRACTION = case(
    (Trial.state.in_(TRIAL_FINAL), 1.0),
    (Trial.total_steps <= 0, 0.0),
    (Trial.steps_done >= Trial.total_steps, 1.0),
    (Trial.steps_done <= 0, 0.0),
    else_=cast(Trial.steps_done, Float) / Trial.total_steps,
)
# Per trial state: how many, their done fractions summed, how many have a validation loss.
_BY_STATE = (
    Trial.state.label("trial_state"),
    func.count(Trial.id).label("trials"),
    func.sum(_DONE_FRACTION).label("done"),
    func.count(Trial.best_val_loss).label("with_val_loss"),
)
_TRIAL_SUMMARIES = (
    select(Trial.task_id, *_BY_STATE)
    .where(Trial.task_id.in_(bindparam("task_ids", expanding=True)))
    .group_by(Trial.task_id, Trial.state)
)
# A status poll in one statement: the task, if the key is valid and its tenant owns the task (another tenant's
# task reads like a missing one, as in api/queries.py), with its trials grouped by state (a row per state).
_TASK_STATUS = (
    select(
        Task.id, Task.tenant_id, Task.state, Task.base_model, Task.training_file_id, Task.validation_file_id, Task.spec,
        Task.best_trial_id, Task.refit_trial_id, Task.error, Task.created_at, Task.started_at, Task.finished_at,
        Task.estimate, Task.waiting, *_BY_STATE,
    )
    .select_from(Task)
    .join(ApiKey, ApiKey.tenant_id == Task.tenant_id)
    .outerjoin(Trial, Trial.task_id == Task.id)
    .where(VALID_KEY, Task.id == bindparam("task_id"))
    .group_by(Task.id, Trial.state)
)
# The final best trial of a task that has one; for the others, every trial with a validation loss (the best
# so far is picked from them by the task's metric: common.metrics.rank_key).
_BEST_TRIALS = (
    select(Trial.task_id, Trial.id, Trial.hyperparameters, Trial.best_val_loss, Trial.best_step, Trial.metric_score,
           Trial.last_train_loss, Trial.index, Trial.selection_loss)
    .where(or_(
        Trial.id.in_(bindparam("best_ids", expanding=True)),
        and_(Trial.task_id.in_(bindparam("open_ids", expanding=True)), Trial.best_val_loss.is_not(None)),
    ))
)


@dataclass
class TrialSummary:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRIAL_STATES, 0))
    done: float = 0.0  # the trials' done fractions, summed
    with_val_loss: int = 0  # trials that reported a validation loss: a best trial so far exists

    @property
    def progress(self) -> float:
        n = sum(self.counts.values())
        return self.done / n if n else 0.0

    def add(self, state: str, trials: int, done: float | None, with_val_loss: int) -> None:
        """One row of `_BY_STATE`."""
        self.counts[state] = self.counts.get(state, 0) + trials
        self.done += float(done or 0.0)
        self.with_val_loss += with_val_loss


def trial_summaries(conn: Connection, task_ids: Sequence[str]) -> dict[str, TrialSummary]:
    summaries = {task_id: TrialSummary() for task_id in task_ids}
    for row in conn.execute(_TRIAL_SUMMARIES, {"task_ids": list(task_ids)}):
        summaries[row.task_id].add(row.trial_state, row.trials, row.done, row.with_val_loss)
    return summaries


def best_trials(
    conn: Connection, tasks: Sequence[TaskFields], summaries: dict[str, TrialSummary]
) -> dict[str, BestTrial]:
    """The final best trial once the task succeeded; until then, the best so far by the task's metric (the
    lowest smoothed validation loss, or the highest metric score: common.metrics.rank_key)."""
    best_ids = [t.best_trial_id for t in tasks if t.best_trial_id]
    open_ids = [t.id for t in tasks if not t.best_trial_id and summaries[t.id].with_val_loss]
    best: dict[str, BestTrial] = {}
    if not best_ids and not open_ids:
        return best
    metrics = {t.id: TaskSpec.from_stored(t.spec).metric for t in tasks}
    keys: dict[str, RankKey] = {}
    for (task_id, trial_id, hyperparameters, best_val_loss, best_step, metric_score, last_train_loss, index,
         selection) in conn.execute(_BEST_TRIALS, {"best_ids": best_ids, "open_ids": open_ids}):
        key = rank_key(metrics[task_id], metric_score=metric_score,
                       val_loss=ranked_val_loss(selection, best_val_loss), last_train_loss=last_train_loss,
                       index=index)
        if task_id in keys and keys[task_id] <= key:
            continue
        keys[task_id] = key
        best[task_id] = BestTrial(id=trial_id, hyperparameters=hyperparameters, best_val_loss=best_val_loss,
                                  best_step=best_step, metric_score=metric_score, selection_loss=selection)
    return best


def seconds_left(task: TaskFields, progress: float, now: datetime) -> float | None:
    """Elapsed x (1 - p) / p for a running task with some progress; None when there is nothing to go on."""
    if task.state != TASK_RUNNING or task.started_at is None or progress <= 0:
        return None
    started = as_utc(task.started_at)
    elapsed = max(0.0, (now - started).total_seconds())
    return round(elapsed * (1 - progress) / progress, 1)


def _task_out(task: TaskFields, summary: TrialSummary, best: BestTrial | None, now: datetime) -> TaskOut:
    spec = TaskSpec.from_stored(task.spec)
    counts = TrialCounts(**{k: v for k, v in summary.counts.items() if k in TrialCounts.model_fields})
    return TaskOut(
        id=task.id,
        tenant_id=task.tenant_id,
        state=task.state,
        base_model=task.base_model,
        training_file=task.training_file_id,
        validation_file=task.validation_file_id,
        validation_split=spec.validation_split,
        strategy=spec.strategy,
        search_space=spec.search_space,
        max_trials=spec.max_trials,
        epochs=spec.epochs,
        max_steps=spec.max_steps,
        max_seq_len=spec.max_seq_len,
        eval_interval=spec.eval_interval,
        early_exit=dict(spec.early_exit),
        seed=spec.seed,
        training=dict(spec.training),
        scheduling=asdict(spec.scheduling),
        evaluation=(spec.evaluation or LOSS).as_dict(),
        objective=spec.objective.as_dict(),
        trial_counts=counts,
        progress=round(summary.progress, 6),
        best_trial=best,
        refit=spec.refit,
        refit_trial_id=task.refit_trial_id,
        estimated_seconds_left=seconds_left(task, summary.progress, now),
        estimate=TaskEstimate.model_validate(task.estimate) if task.estimate else None,
        # Only while a trial is pending: the scheduler clears it a round after they start, this at once.
        waiting=TaskWaiting.model_validate(task.waiting) if task.waiting and summary.counts[TRIAL_PENDING] else None,
        suffix=spec.suffix,
        metadata=dict(spec.metadata) if spec.metadata is not None else None,
        integrations=[dict(i) for i in spec.integrations],
        error=task.error,
        created_at=task.created_at,
        started_at=task.started_at,
        finished_at=task.finished_at,
    )


def _views(conn: Connection, tasks: Sequence[TaskFields]) -> list[TaskOut]:
    if not tasks:
        return []
    summaries = trial_summaries(conn, [t.id for t in tasks])
    best = best_trials(conn, tasks, summaries)
    now = utcnow()
    return [_task_out(t, summaries[t.id], best.get(t.id), now) for t in tasks]


def task_views(session: Session, tasks: Sequence[Task]) -> list[TaskOut]:
    session.flush()  # Core statements do not autoflush: the counts must include this session's own changes
    return _views(session.connection(), tasks)


def task_view(session: Session, task: Task) -> TaskOut:
    return task_views(session, [task])[0]


def draft_view(task: Task, trials: int) -> TaskOut:
    """A dry run's task (`POST /v1/tasks?dry_run=true`): nothing was written, so no id, and every trial pending."""
    summary = TrialSummary()
    summary.add(TRIAL_PENDING, trials, 0.0, 0)
    return _task_out(task, summary, None, utcnow())


def task_status(conn: Connection, *, key_hash: str, task_id: str) -> TaskOut | None:
    """The task as clients poll it: one statement (`_TASK_STATUS`), and a second for the best trial once one
    has a validation loss. None when the key is not valid or its tenant has no such task (the caller tells
    which: that is the rare path)."""
    rows = conn.execute(_TASK_STATUS, {"key_hash": key_hash, "task_id": task_id}).all()
    if not rows:
        return None
    task, summary = rows[0], TrialSummary()
    for row in rows:
        if row.trial_state is not None:  # None: the outer join's row of a task without trials
            summary.add(row.trial_state, row.trials, row.done, row.with_val_loss)
    best = best_trials(conn, [task], {task.id: summary})
    return _task_out(task, summary, best.get(task.id), utcnow())
