"""Early exit in the running service: each task's policy (scheduler/early_exit/policy.py, pure) applied to its trials'
stored curves, and its decisions made into state changes, events and worker commands.

Runs in the scheduler's ingest transaction for the tasks whose trials reported something (a validation point,
an end, a pause), so a decision is made on every new evaluation (README, "Early exit"):

- stop: the trial becomes `stopped_early` with its reason, and a `trial.stopped_early` event carries the
  numbers behind it. A running one is then taken out of its pack by a `stop_trials` command (`stop_requests`),
  which asks the worker to export its best-validation adapter first when it overfitted.
- hold (reached its warm-up boundary before the rest of its task): it is asked to pause — checkpoint and
  give up its slot — and waits in `waiting` (`should_pause`): always while other trials of the task are
  pending (ALTO's rotation: they need the slot for their warm-up), and with none pending when the running
  trials it waits for are still at least PAUSE_MIN_STEPS steps from their boundaries (a trial of a larger
  batch size reaches its boundary in fewer steps; training on would spend samples on a trial the ranking
  cuts three times in four). A trial only a few steps ahead trains on: pausing it would cost a checkpoint
  and a slot round trip, and when every member of a pack pauses at once the pack ends (measured: the
  live early-exit sweep on the H100, benchmarks/results/sweeps/).
- resume (kept by the warm-up ranking while waiting): back to pending, to continue from its checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from common import states
from common.events import record_event
from common.metrics import METRIC_SPLIT, SCORED_METRICS
from common.tables import MetricPoint, Pack, Task, Trial
from scheduler.early_exit.config import EarlyExitConfig, EarlyExitSpecError, from_spec
from scheduler.early_exit.policy import curves_from_losses, decide, rung_steps
from scheduler.planning.cost import batch_size, tokens_per_step

log = logging.getLogger(__name__)


# A held trial with nothing pending pauses only when the trials it waits for are this many steps away.
PAUSE_MIN_STEPS = 5


def should_pause(pending: bool, steps_to_go: Sequence[int]) -> bool:
    """Whether a trial held at its warm-up boundary gives up its slot, given whether trials of its task are
    pending and how many steps each running trial it waits for still has to its boundary."""
    return pending or max(steps_to_go, default=0) >= PAUSE_MIN_STEPS


@dataclass(frozen=True)
class PauseRequest:
    pack_id: str
    worker_id: str
    trial_id: str
    placed_at: str  # which placement of the trial (it may be paused in the same pack again later)


def apply_early_exit(session: Session, task_ids: Iterable[str], now: datetime) -> list[PauseRequest]:
    """Decide for every given task that has a policy; returns the running trials to pause now."""
    pauses: list[PauseRequest] = []
    for task_id in sorted(set(task_ids)):
        task = session.get(Task, task_id)
        if task is None or task.state not in (states.TASK_QUEUED, states.TASK_RUNNING):
            continue
        try:
            config = from_spec(task.parsed_spec.early_exit)
        except EarlyExitSpecError as exc:  # a task stored before the policy's parameters changed
            log.warning("task %s: unusable early-exit spec (%s); no early exit", task.id, exc)
            continue
        if config.policy == "none":
            continue
        pauses += _apply(session, task, config, now)
    return pauses


def _apply(session: Session, task: Task, config: EarlyExitConfig, now: datetime) -> list[PauseRequest]:
    # Locked in id order, as every transaction that locks several trials (ingest.lock_trials, the API's cancel),
    # so that no two wait for each other; read in index order.
    locked = session.scalars(
        select(Trial).where(Trial.task_id == task.id).order_by(Trial.id).with_for_update(key_share=True)
    ).all()
    # A refit (trained after the search on every row, never validated) is no part of the policy's ranking.
    trials = sorted((t for t in locked if t.refit_of is None), key=lambda t: t.index)
    points: dict[str, dict[str, list[tuple[int, float]]]] = {t.id: {"train": [], "val": [], METRIC_SPLIT: []}
                                                             for t in trials}
    # A task judged by a scored metric (generative, or reward accuracy) ranks its rungs by the scores the worker
    # reported there (by_metric).
    by_metric = task.parsed_spec.metric in SCORED_METRICS
    splits = ("train", "val", METRIC_SPLIT) if by_metric else ("train", "val")
    for trial_id, step, split, loss in session.execute(
        select(MetricPoint.trial_id, MetricPoint.step, MetricPoint.split, MetricPoint.loss)
        .where(MetricPoint.trial_id.in_(points), MetricPoint.split.in_(splits))
    ):
        points[trial_id][split].append((step, loss))
    max_seq_len = task.parsed_spec.max_seq_len
    curves = []
    for t in trials:
        curves.append(curves_from_losses(t.id, t.state, t.total_steps, batch_size(t.hyperparameters),
                                         tokens_per_step(t.hyperparameters, max_seq_len),
                                         points[t.id]["train"], points[t.id]["val"], points[t.id][METRIC_SPLIT]))
    by_id = {t.id: t for t in trials}
    pending = any(t.state == states.TRIAL_PENDING for t in trials)
    to_boundary = [next_rung - t.steps_done for t in trials if t.state == states.TRIAL_RUNNING
                   for next_rung in [s for s in rung_steps(config, t.total_steps) if s > t.steps_done][:1]]
    pause = should_pause(pending, [n for n in to_boundary if n > 0])
    pauses = []
    for decision in decide(config, curves, by_metric=by_metric):
        trial = by_id[decision.trial_id]
        if (decision.action == "stop" and decision.export_best and trial.checkpoint_key
                and trial.state in (states.TRIAL_WAITING, states.TRIAL_PENDING)):
            # Overfitting while it is out of any pack (held in its checkpoint), with no worker to export its best
            # adapter: it is placed again (resuming from the checkpoint, which holds its best adapter), the same
            # decision recurs from its unchanged curve once it runs, and its worker exports that adapter as it
            # takes it out (stop_mode "export").
            if trial.state == states.TRIAL_WAITING:
                trial.state = states.TRIAL_PENDING
                record_event(session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id,
                             type="trial.resumed", message=f"trial {trial.index}: resumed to export its best "
                             f"adapter. {decision.message}", data={**decision.event_data(), "to_export": True})
        elif decision.action == "stop" and trial.state in states.TRIAL_ACTIVE:
            trial.state = states.TRIAL_STOPPED_EARLY
            trial.stop_reason = decision.reason
            trial.finished_at = now
            trial.awaiting_admission = False
            record_event(session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id,
                         type="trial.stopped_early", message=f"trial {trial.index}: {decision.message}",
                         data=decision.event_data())
        elif decision.action == "resume" and trial.state == states.TRIAL_WAITING:
            trial.state = states.TRIAL_PENDING
            record_event(session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id,
                         type="trial.resumed", message=f"trial {trial.index}: {decision.message}",
                         data=decision.event_data())
        elif decision.action == "hold" and trial.state == states.TRIAL_RUNNING and pause and trial.pack_id:
            pack = session.get(Pack, trial.pack_id)
            if pack is not None and pack.state in states.PACK_LIVE:
                pauses.append(PauseRequest(pack.id, pack.worker_id, trial.id, placement(trial)))
    return pauses


def placement(trial: Trial) -> str:
    """Tells one placement of a trial from the next (commands are sent once per placement)."""
    return trial.started_at.isoformat() if trial.started_at else ""


def stop_mode(trial: Trial) -> str:
    """How the worker takes a stopped trial out: with its best adapter exported when it overfitted."""
    return "export" if trial.state == states.TRIAL_STOPPED_EARLY and trial.stop_reason == "overfitting" else "drop"
