"""A task's end, inside the caller's transaction (scheduler/service/daemon.py sequences it): queued tasks with a
running trial become running, and tasks whose trials all ended get their best trial, their state and their actual
cost beside the estimate; a task that asked for a refit (`"refit": true`) first gets its refit trial, and ends
when that ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, case, func, select
from sqlalchemy.orm import Session

from common import states
from common.events import record_event
from common.metrics import METRIC_SPLIT, SCORED_METRICS, rank_key, ranked_val_loss, selection_loss
from common.tables import MetricPoint, Task, Trial, as_utc, new_id
from common.task_spec import refit_steps
from common.usage import task_usage


def best_val(session: Session, trial_id: str) -> tuple[float | None, int | None]:
    """The trial's lowest validation loss stored and its step (the earliest of equal ones)."""
    row = session.execute(
        select(MetricPoint.loss, MetricPoint.step)
        .where(MetricPoint.trial_id == trial_id, MetricPoint.split == "val")
        .order_by(MetricPoint.loss, MetricPoint.step)
        .limit(1)
    ).first()
    return (row[0], row[1]) if row else (None, None)


def trial_selection_loss(session: Session, trial_id: str) -> float | None:
    """The trial's stored validation curve scored as its task's trials are ranked (common.metrics.selection_loss)."""
    return trial_selection_losses(session, [trial_id])[trial_id]


def trial_selection_losses(session: Session, trial_ids: Sequence[str]) -> dict[str, float | None]:
    """`trial_selection_loss` of several trials, with one query."""
    curves: dict[str, list[float]] = {trial_id: [] for trial_id in trial_ids}
    if trial_ids:
        rows = session.execute(
            select(MetricPoint.trial_id, MetricPoint.loss)
            .where(MetricPoint.trial_id.in_(list(trial_ids)), MetricPoint.split == "val")
            .order_by(MetricPoint.trial_id, MetricPoint.step)
        )
        for trial_id, loss in rows:
            curves[trial_id].append(loss)
    return {trial_id: selection_loss(losses) for trial_id, losses in curves.items()}


def newest_metric_score(session: Session, trial_id: str) -> float | None:
    """The score of the trial's "metric" point of the highest step (a later score replaces an earlier one)."""
    return session.scalar(
        select(MetricPoint.loss)
        .where(MetricPoint.trial_id == trial_id, MetricPoint.split == METRIC_SPLIT)
        .order_by(MetricPoint.step.desc())
        .limit(1)
    )


def _open_task_counts() -> Select[str, str, int, int, int]:
    """Each queued or running task: (id, state, its trials, how many ended, how many are pending)."""
    return (select(Task.id, Task.state, func.count(Trial.id),
                   func.sum(case((Trial.state.in_(sorted(states.TRIAL_FINAL)), 1), else_=0)),
                   func.sum(case((Trial.state == states.TRIAL_PENDING, 1), else_=0)))
            .join(Trial, Trial.task_id == Task.id)
            .where(Task.state.in_((states.TASK_QUEUED, states.TASK_RUNNING)))
            .group_by(Task.id, Task.state))


def finalize_tasks(session: Session, now: datetime) -> None:
    """Queued tasks with a running trial become running; tasks whose trials all ended get their result."""
    # Locked (skipping tasks the API is cancelling right now) so a cancel is never overwritten: only the tasks with
    # something to change, found by one count of every open task's trials (one query per open task each round was
    # a good part of a round at 500 open tasks; benchmarks/cluster_scale.py).
    changing = [task_id for task_id, state, trials, final, pending in session.execute(_open_task_counts())
                if final == trials or (state == states.TASK_QUEUED and pending < trials)]
    open_tasks = session.scalars(
        select(Task)
        .where(Task.id.in_(changing), Task.state.in_((states.TASK_QUEUED, states.TASK_RUNNING)))
        .with_for_update(skip_locked=True, key_share=True)
    ).all() if changing else []
    for task in open_tasks:
        trials = session.scalars(select(Trial).where(Trial.task_id == task.id)).all()
        if task.state == states.TASK_QUEUED and any(t.state != states.TRIAL_PENDING for t in trials):
            task.state = states.TASK_RUNNING
            task.started_at = now
            record_event(session, tenant_id=task.tenant_id, task_id=task.id, type="task.running",
                         message="training started")
        if not trials or any(t.state not in states.TRIAL_FINAL for t in trials):
            continue
        search = [t for t in trials if t.refit_of is None]
        # A trial stopped early for overfitting had its best adapter saved: it competes like a completed one.
        done = [t for t in search if t.state in (states.TRIAL_COMPLETED, states.TRIAL_STOPPED_EARLY) and t.adapter_key]
        if not done:
            task.finished_at = now
            record_actual(session, task, now)
            task.state = states.TASK_FAILED
            task.error = "no trial completed: " + "; ".join(sorted({t.error or t.state for t in trials}))
            record_event(session, tenant_id=task.tenant_id, task_id=task.id, type="task.failed",
                         level="error", message=task.error)
            continue
        metric = task.parsed_spec.metric
        best = best_trial(metric, done)
        task.best_trial_id = best.id
        if task.parsed_spec.refit and task.refit_trial_id is None:
            start_refit(session, task, best, index=1 + max(t.index for t in trials))
            continue  # the task ends with its refit
        task.finished_at = now
        record_actual(session, task, now)
        task.state = states.TASK_SUCCEEDED
        data: dict[str, Any] = {"best_trial_id": best.id, "best_val_loss": best.best_val_loss,
                                "selection_loss": best.selection_loss}
        by = ""
        if metric in SCORED_METRICS:
            data.update(metric=metric, metric_score=best.metric_score)
            by = f" ({metric} {'n/a' if best.metric_score is None else f'{best.metric_score:.3f}'})"
        refit = next((t for t in trials if t.id == task.refit_trial_id), None)
        refitted = ""
        if refit is not None:
            data["refit_trial_id"] = refit.id
            outcome = "is ready" if refit.adapter_key else f"did not complete ({refit.error or refit.state})"
            refitted = f"; its refit on training + validation rows {outcome}"
            if not refit.adapter_key:
                record_event(session, tenant_id=task.tenant_id, task_id=task.id, trial_id=refit.id,
                             type="task.refit_failed", level="warn",
                             message=f"the refit of trial {best.index} {outcome}; the best trial's adapter is the "
                                     "task's result")
        record_event(
            session, tenant_id=task.tenant_id, task_id=task.id, trial_id=best.id, type="task.succeeded",
            message=f"{len(done)} of {len(search)} trials completed; best is trial {best.index}{by}{refitted}",
            data=data,
        )


def start_refit(session: Session, task: Task, best: Trial, *, index: int) -> Trial:
    """The task's refit: a pending trial of ``best``'s configuration (its seed too) on the training and validation
    rows, for as many passes over them as ``best``'s adapter made over the training rows (`refit_steps`)."""
    spec = task.parsed_spec
    assert spec.training_rows is not None and spec.validation_rows is not None, "refit without row counts"
    winner_steps = best.best_step or best.steps_done or best.total_steps  # the step its adapter was taken at
    refit = Trial(id=new_id("trial"), task_id=task.id, tenant_id=task.tenant_id, index=index,
                  state=states.TRIAL_PENDING, hyperparameters=dict(best.hyperparameters), refit_of=best.id,
                  total_steps=refit_steps(winner_steps, spec.training_rows, spec.validation_rows))
    session.add(refit)
    task.refit_trial_id = refit.id
    record_event(session, tenant_id=task.tenant_id, task_id=task.id, trial_id=refit.id, type="task.refit_started",
                 message=f"trial {best.index} won; its configuration trains again on the {spec.training_rows} "
                         f"training and {spec.validation_rows} validation rows for {refit.total_steps} steps "
                         f"(trial {index})",
                 data={"best_trial_id": best.id, "refit_trial_id": refit.id, "total_steps": refit.total_steps})
    return refit


def record_actual(session: Session, task: Task, now: datetime) -> None:
    """The task's actual cost beside its estimate (`task.estimate["actual"]`): tokens trained and GPU seconds from
    its usage (common/usage.py), wall seconds from submission to the end. A task without an estimate (submitted
    before estimates) gets none: there is nothing to compare it with."""
    if task.estimate is None:
        return
    tokens, gpu_seconds = task_usage(session, task.id)
    wall_s = (as_utc(now) - as_utc(task.created_at)).total_seconds()
    actual = {"tokens": tokens, "gpu_seconds": round(gpu_seconds, 3), "wall_seconds": round(wall_s, 3)}
    task.estimate = {**task.estimate, "actual": actual}  # a new dict: the JSON column is saved only when replaced


def best_trial(metric: str, trials: Sequence[Trial]) -> Trial:
    """The task's best of its finished trials, by its metric (common.metrics.rank_key): the lowest smoothed
    validation loss (common.metrics.selection_loss), or the highest metric score (ties and unscored trials by that
    loss)."""
    return min(trials, key=lambda t: rank_key(metric, metric_score=t.metric_score,
                                              val_loss=ranked_val_loss(t.selection_loss, t.best_val_loss),
                                              last_train_loss=t.last_train_loss, index=t.index))
