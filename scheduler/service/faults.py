"""Who pays for a failure, in the scheduler's transaction (the policies, pure: scheduler/planning/faults.py).

Three kinds of end that put a running trial back to pending, by whose doing (`Blame`):

- ``"trial"``, its own failure: its worker reported that this trial failed (an exception in its step or its
  set-up, its data, its OOM; the engine retries a failed joint step slot by slot, so one trial's error is its own)
  or could not admit it as a back-fill. The attempt it was placed with stays spent; at `MAX_TRIAL_ATTEMPTS` it
  fails for good.
- ``"worker"``, its worker's loss: the process died or restarted under its id (a new incarnation), its heartbeat
  stopped, it no longer names the pack (a rank died, its outbox overflowed), or the whole pack failed before or
  beside any trial's own work (`pack.failed`: the base model would not load, the artifact store could not be read
  or written: the worker said it could load the model and run the pack, and could not; whatever it was, it was no
  one trial's doing, as every trial of the pack ended together). The attempt is given back; the trial waits a
  backoff before it may be placed again; the loss goes on the worker's record, and a worker that loses packs
  repeatedly is quarantined (no packs for a while). A trial whose worker is lost `MAX_TRIAL_WORKER_LOSSES` times
  fails (it may be what kills them).
- ``"none"``: it never trained (a back-fill whose pack ended before taking it): given back, no wait.

No tenant's task fails because a process crashed: only its own trials' failures, or the loss bound, end it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from common import states
from common.events import record_event
from common.settings import Settings, get_settings
from common.tables import MetricPoint, Pack, Trial, Worker
from common.telemetry import scheduler_metrics
from scheduler.planning.faults import FaultPolicy, quarantine_s_for, recent_losses, requeue_delay_s
from scheduler.service.cluster_state import quarantine_left_s
from scheduler.service.task_results import best_val, newest_metric_score, trial_selection_loss

log = logging.getLogger(__name__)

Blame = Literal["trial", "worker", "none"]
WAITING_FOR_WORKER = "trial.waiting_for_worker"


def fault_policy(settings: Settings | None = None) -> FaultPolicy:
    s = settings or get_settings()
    return FaultPolicy(
        requeue_backoff_s=s.requeue_backoff_s, requeue_backoff_max_s=s.requeue_backoff_max_s,
        quarantine_losses=s.worker_quarantine_losses, quarantine_window_s=s.worker_quarantine_window_s,
        quarantine_s=s.worker_quarantine_s, quarantine_max_s=s.worker_quarantine_max_s,
    )


def requeue_trial(session: Session, trial: Trial, reason: str, *, blame: Blame, now: datetime,
                  policy: FaultPolicy | None = None) -> None:
    """Back to pending, resuming from its newest checkpoint (its curve is cut back to that step), or from step 0
    without one; or failed, once its own failures spent its attempts or its workers were lost too often. ``blame``
    says who pays for this end (the module's docstring)."""
    policy = policy or fault_policy()
    kept_step = _cut_back(session, trial)
    error, wait_s = None, 0.0
    if blame != "trial":  # not its doing: the attempt it was placed with is given back
        trial.attempts = max(0, trial.attempts - 1)
    elif trial.attempts >= states.MAX_TRIAL_ATTEMPTS:
        error = f"{reason}; gave up after {trial.attempts} attempts"
    if blame == "worker":
        trial.worker_losses += 1
        wait_s = requeue_delay_s(trial.worker_losses, policy)
        if trial.worker_losses >= states.MAX_TRIAL_WORKER_LOSSES:
            error = (f"{reason}; its worker was lost {trial.worker_losses} times (each time the process running it "
                     "died, restarted or stopped reporting): a trial that every worker it runs on loses may be what "
                     "crashes them, so it is not placed again")
    trial.not_before = now + timedelta(seconds=wait_s) if wait_s > 0 and error is None else None
    data: dict[str, object] = {"resume_step": kept_step, "blame": blame, "attempts": trial.attempts,
                               "worker_losses": trial.worker_losses}
    if error is not None:
        trial.state, trial.error, trial.finished_at = states.TRIAL_FAILED, error, now
        kind, level, message = "trial.failed", "error", f"trial {trial.index} failed: {error}"
    else:
        trial.state = states.TRIAL_PENDING
        resumed = f" from its checkpoint at step {kept_step}" if kept_step else ""
        cost = {"trial": f"attempt {trial.attempts} of {states.MAX_TRIAL_ATTEMPTS} spent",
                "worker": f"no attempt spent; placed again in {wait_s:.0f}s at the earliest",
                "none": "no attempt spent"}[blame]
        kind, level = "trial.requeued", "warn"
        message = f"trial {trial.index} back to pending{resumed}: {reason} ({cost})"
        if trial.not_before is not None:
            data["not_before"] = trial.not_before.isoformat()
    record_event(session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id, type=kind,
                 level=level, message=message, data=data)


def _cut_back(session: Session, trial: Trial) -> int:
    """Out of its pack, its stored curve and numbers cut back to its newest checkpoint; returns that step (0:
    none, it starts again)."""
    never_joined, trial.awaiting_admission = trial.awaiting_admission, False
    kept_step = trial.checkpoint_step or 0
    trial.pack_id = None
    if never_joined:  # a back-fill its pack never took trained nothing there: its curve and numbers stand
        return kept_step
    session.execute(delete(MetricPoint).where(MetricPoint.trial_id == trial.id, MetricPoint.step > kept_step))
    trial.steps_done = kept_step
    trial.best_val_loss, trial.best_step = best_val(session, trial.id)
    trial.selection_loss = trial_selection_loss(session, trial.id)
    trial.metric_score = newest_metric_score(session, trial.id)
    trial.last_train_loss = session.scalar(
        select(MetricPoint.loss).where(MetricPoint.trial_id == trial.id, MetricPoint.split == "train",
                                       MetricPoint.step == kept_step)
    )
    return kept_step


def lose_pack(session: Session, pack: Pack, now: datetime, reason: str, policy: FaultPolicy | None = None) -> None:
    """The pack's process is gone: the pack is lost, its running trials go back to pending (each from its newest
    checkpoint, no attempt spent), and the loss goes on its worker's record. Reports that still arrive from it are
    dropped (their trials left the pack)."""
    log.warning("pack %s lost: %s", pack.id, reason)
    pack.state = states.PACK_LOST
    pack.finished_at = now
    requeue_for_worker(session, pack, now, reason, policy or fault_policy())


def requeue_for_worker(session: Session, pack: Pack, now: datetime, reason: str, policy: FaultPolicy) -> None:
    """The pack ended by its worker's doing (lost, or failed as a whole): its running trials go back to pending at
    no attempt's cost (a back-fill it never took, at no cost nor wait), and the worker is charged one lost pack."""
    worker = session.get(Worker, pack.worker_id)
    if worker is not None and worker.current_pack_id == pack.id:
        worker.current_pack_id = None
    trials = session.scalars(
        select(Trial).where(Trial.pack_id == pack.id, Trial.state == states.TRIAL_RUNNING).order_by(Trial.id)
        .with_for_update(key_share=True)  # in id order, as all that lock several trials (ingest.lock_trials)
    ).all()
    for trial in trials:
        if trial.awaiting_admission:  # it never joined: nothing of it was lost
            requeue_trial(session, trial, f"pack {pack.id} ended before it could join", blame="none", now=now,
                          policy=policy)
        else:
            requeue_trial(session, trial, reason, blame="worker", now=now, policy=policy)
    if worker is not None:
        charge_worker(session, worker, now, policy, [t for t in trials if t.state == states.TRIAL_PENDING])


def charge_worker(session: Session, worker: Worker, now: datetime, policy: FaultPolicy,
                  requeued: Sequence[Trial]) -> None:
    """One lost pack on the worker's record (its history kept to the quarantine window); past the policy's count,
    the worker is quarantined: the planners give it no pack until `quarantined_until` (scheduler/service/
    cluster_state.py `usable_workers`). Said once, to the operator (a log line, the metric, the admin views: a
    worker is no tenant's) and to each trial just requeued from it (`trial.waiting_for_worker`)."""
    history = recent_losses([*(float(t) for t in worker.lost_packs or ()), now.timestamp()], now.timestamp(), policy)
    worker.lost_packs = history  # a new list: a JSON column is saved only when replaced
    if quarantine_left_s(worker, now) > 0:
        return  # out of the planners' sight already; the loss stays on its record
    seconds = quarantine_s_for(len(history), worker.quarantines, policy)
    if seconds is None or seconds <= 0:
        return
    worker.quarantines += 1
    until = now + timedelta(seconds=seconds)
    worker.quarantined_until = until
    window_min = policy.quarantine_window_s / 60
    log.warning("worker %s quarantined for %.0fs, until %s: it lost %d packs within %.0f min (quarantine %d in a "
                "row)", worker.id, seconds, until.isoformat(), len(history), window_min, worker.quarantines)
    scheduler_metrics().quarantines.inc()  # when decided: a batch rolled back and read again counts it twice (rare)
    for trial in requeued:
        record_event(
            session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id, type=WAITING_FOR_WORKER,
            level="warn",
            message=f"trial {trial.index} waits for another worker: worker {worker.id}, which it ran on, lost "
                    f"{len(history)} packs within {window_min:.0f} min and gets none until {until:%H:%M:%S} UTC",
            data={"worker_id": worker.id, "quarantined_until": until.isoformat(), "lost_packs": len(history)},
        )


def credit_worker(session: Session, worker_id: str) -> None:
    """A pack ended well on the worker: its next quarantine, if any, starts again from the shortest."""
    worker = session.get(Worker, worker_id)
    if worker is not None and worker.quarantines:
        worker.quarantines = 0


def reap_lost_workers(session: Session, now: datetime, timeout_s: float,
                      policy: FaultPolicy | None = None) -> list[str]:
    """Workers silent for longer than the timeout are lost; their packs' trials go back to pending. A draining one
    too (worker/drain.py): silent, it has exited, and a pack it had not ended by then is lost."""
    cutoff = now - timedelta(seconds=timeout_s)
    lost = session.scalars(
        select(Worker).where(Worker.state.in_((states.WORKER_ALIVE, states.WORKER_DRAINING)),
                             Worker.last_heartbeat < cutoff)
    ).all()
    for worker in lost:
        lose_worker(session, worker, now, f"worker {worker.id} was lost", policy)
    return [w.id for w in lost]


def lose_worker(session: Session, worker: Worker, now: datetime, reason: str, policy: FaultPolicy | None) -> None:
    """The worker is lost (the planners give it nothing until a beat says it is well again): its live packs are
    lost, for ``reason``."""
    worker.state = states.WORKER_LOST
    worker.current_pack_id = None
    packs = session.scalars(select(Pack).where(Pack.worker_id == worker.id, Pack.state.in_(states.PACK_LIVE))).all()
    for pack in packs:
        lose_pack(session, pack, now, reason, policy)


def stalled_s(pack_id: str | None, progressed_at: float | None, sent_at: float, stall_s: float) -> float | None:
    """How long the pack a heartbeat names has made no progress, when that is longer than ``stall_s`` (the process
    beats, but its training hangs); None while it progresses, or when the beat names no pack or does not say (a
    worker from before progress was reported). Both times are the sender's clock.

    >>> stalled_s("p", 100.0, 4000.0, 3600.0), stalled_s("p", 100.0, 200.0, 3600.0), stalled_s(None, 1.0, 9e9, 1.0)
    (3900.0, None, None)
    """
    if pack_id is None or progressed_at is None:
        return None
    idle_s = sent_at - progressed_at
    return idle_s if idle_s > stall_s else None
