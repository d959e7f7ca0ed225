"""Applies worker reports from the bus to the database, in one transaction per batch.

Idempotent by construction, so a batch replayed after a crash changes nothing twice: metric points are
unique per (trial, step, split), and every state change is guarded by the trial still belonging to the
reporting pack (a report from a pack that was declared lost is dropped).

Liveness is judged by what a message carries, not by when it is read: a heartbeat counts from the time it
was sent (an old one replayed after a restart proves nothing), a heartbeat from a new process under a known
worker id (a new `incarnation`) ends the packs of the process it replaced at once, a heartbeat that names no
pack or another pack ends the worker's running pack it does not name, a heartbeat whose pack has made no progress
for LORAPLANE_WORKER_STALL_S (a hung process beats on) ends that pack and keeps its worker lost while it says so, and
reports from a process other than the one that started their pack are dropped. A lost pack bills no tokens: its
trials train again from their checkpoints (common/usage.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, insert, select, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from common import states
from common.bus import BACKFILL_NOT_JOINED
from common.events import record_event
from common.messages import (
    MALFORMED,
    WITH_POINTS,
    CheckpointSaved,
    PackFailed,
    PackFinished,
    PackProfile,
    PackProgress,
    PackRefused,
    PackReport,
    PackStarted,
    Points,
    Report,
    TrialAdmitted,
    TrialCheckpoint,
    TrialCheckpointLost,
    TrialFinished,
    TrialRejected,
    TrialReport,
    Wake,
    WorkerHeartbeat,
)
from common.metrics import METRIC_SPLIT
from common.settings import get_settings
from common.tables import Checkpoint, MetricPoint, Pack, Trial, TrialUsage, Worker, as_utc, utcnow
from scheduler.planning.cost import Progress
from scheduler.planning.faults import FaultPolicy
from scheduler.service.faults import (
    credit_worker,
    fault_policy,
    lose_pack,
    lose_worker,
    requeue_for_worker,
    requeue_trial,
    stalled_s,
)
from scheduler.service.task_results import newest_metric_score, trial_selection_losses
from scheduler.service.telemetry import message_dropped

log = logging.getLogger(__name__)

# The most GPUs a heartbeat may claim for its worker: more than one host holds (8 to 16 today). Its per-GPU memory
# times its GPUs is the planner's memory for it, which must stay far inside CP-SAT's 64-bit integers.
MAX_WORKER_GPUS = 64
MAX_WORKER_PACKS = 8  # LORAPLANE_WORKER_MAX_PACKS's bound
INT64_MAX = 2**63 - 1  # the BIGINT columns


def ingest(
    session: Session, messages: Sequence[Report], now: datetime | None = None, touched: set[str] | None = None,
    *, stale_after_s: float | None = None, aborts: set[tuple[str, str]] | None = None,
    policy: FaultPolicy | None = None, stall_after_s: float | None = None,
) -> bool:
    """Returns True when something changed that the planner should look at. ``touched`` collects the tasks
    whose trials got a validation point, started in a pack or ended (their early-exit policy has something new
    to decide on).
    A heartbeat sent more than ``stale_after_s`` (default: the worker timeout) ago is ignored; ``aborts``
    collects (worker, pack) for workers whose heartbeat names a pack the scheduler no longer counts on (they
    should stop it). ``policy``: who pays for a failure, and how (default: the settings'). A pack whose heartbeats
    say it made no progress for ``stall_after_s`` (default: LORAPLANE_WORKER_STALL_S) is lost."""
    now = now or utcnow()
    touched = touched if touched is not None else set()
    aborts = aborts if aborts is not None else set()
    stale_after_s = get_settings().worker_timeout_s if stale_after_s is None else stale_after_s
    stall_after_s = get_settings().worker_stall_s if stall_after_s is None else stall_after_s
    policy = policy or fault_policy()
    replan = False
    # The batch's trials (locked) and packs, each read once and held for the batch (the session keeps only weak
    # references to its rows): the reports read them from the session, not with a query each.
    _held = (lock_trials(session, messages), _batch_packs(session, messages))
    # The points of consecutive Points messages go in with one statement (one per message was most of ingest's
    # round trips at 256 workers); any other report is applied after the points before it are stored.
    buffer = PointBuffer()
    for message in messages:
        try:
            if isinstance(message, Points) and _from_pack_process(session, message):
                touched |= _points(session, message, buffer)
                continue
            buffer.flush(session)
            if isinstance(message, Wake):
                replan = True
            elif isinstance(message, WorkerHeartbeat):
                replan |= _heartbeat(session, message, now, (stale_after_s, stall_after_s), aborts, policy)
            elif not _from_pack_process(session, message):
                log.info("dropping a %r report from a process that does not run pack %s", message.type,
                         message.pack_id)
            else:
                replan |= _pack_report(session, message, now, touched, policy, buffer)
        except (KeyError, TypeError, ValueError, OverflowError):
            # A report that does not make sense (an implausible progress) must not wedge the stream: log it and go on.
            log.exception("dropping a malformed %r message", message.type)
            message_dropped(MALFORMED)
    buffer.flush(session)
    buffer.score(session)
    return replan


def _batch_packs(session: Session, messages: Sequence[Report]) -> list[Pack]:
    pack_ids = {m.pack_id for m in messages if isinstance(m, PackReport) and m.pack_id}
    return list(session.scalars(select(Pack).where(Pack.id.in_(pack_ids)))) if pack_ids else []


def _pack_report(session: Session, m: PackReport, now: datetime, touched: set[str], policy: FaultPolicy,
                 buffer: PointBuffer) -> bool:
    """Applies one report of a pack (Points are buffered by `ingest`); True when the planner should look again.
    The points a report carries are stored before the report itself is applied."""
    if isinstance(m, TrialCheckpoint | TrialFinished):
        touched |= _points(session, m, buffer)
        buffer.flush(session)
    if isinstance(m, PackStarted):
        touched |= _pack_started(session, m, now)
    elif isinstance(m, TrialCheckpoint):
        _trial_checkpoint(session, m)
    elif isinstance(m, CheckpointSaved):
        _checkpoint_saved(session, m)
    elif isinstance(m, TrialCheckpointLost):
        _trial_checkpoint_lost(session, m)
    elif isinstance(m, TrialAdmitted):
        touched |= _trial_admitted(session, m)
    elif isinstance(m, TrialRejected):
        return _trial_rejected(session, m, now)
    elif isinstance(m, TrialFinished):
        return _trial_finished(session, m, now, touched, policy)
    elif isinstance(m, PackProfile):
        _pack_profile(session, m)
    elif isinstance(m, PackProgress):
        _pack_progress(session, m)
    elif isinstance(m, PackFinished | PackFailed):
        _pack_ended(session, m, now, policy)
        return True
    elif isinstance(m, PackRefused):
        return _pack_refused(session, m, now, policy)
    return False


def lock_trials(session: Session, messages: Sequence[Report]) -> list[Trial]:
    """Lock every trial the batch names (its reports' `trial_id`s and their points'), in id order, before any is
    read. Every transaction that locks several trials locks them in id order (the API's cancel, `lose_pack`):
    in message order, two of them could each hold a trial the other waits for, and the database breaks such a
    deadlock by failing one (the batch would be retried; a cancel would answer 503).

    Every row lock the service takes is FOR NO KEY UPDATE (`key_share=True`; no statement changes a key): an
    insert that only references a locked row (an event or a point naming its task, trial or tenant takes FOR KEY
    SHARE on it) does not wait for it. With FOR UPDATE a cancel that held its task's row and waited for a trial
    deadlocked with this batch, which held the trial and inserted an event naming the task."""
    ids: set[str] = set()
    for m in messages:
        if isinstance(m, TrialReport):
            ids.add(m.trial_id)
        if isinstance(m, WITH_POINTS):
            ids.update(point.trial_id for point in m.points)
    if not ids:
        return []
    # The rows themselves, not only their ids: the caller holds them, and `_reporting_trial` reads them from the
    # session.
    # Read fresh (populate_existing): a row the session already held must not keep values from before the lock.
    return list(session.execute(select(Trial).where(Trial.id.in_(sorted(ids))).order_by(Trial.id)
                                .with_for_update(key_share=True).execution_options(populate_existing=True))
                .scalars())


def _sent_at(m: WorkerHeartbeat | PackReport, now: datetime) -> datetime:
    """When the message was sent, by its sender's clock (never later than now); a message that does not say
    counts as sent now."""
    return now if m.sent_at is None else min(now, datetime.fromtimestamp(m.sent_at, UTC))


def _heartbeat(session: Session, m: WorkerHeartbeat, now: datetime, limits_s: tuple[float, float],
               aborts: set[tuple[str, str]], policy: FaultPolicy) -> bool:
    """Applies one beat (``limits_s``: how old a beat may be, how long its pack may go without progress)."""
    (stale_after_s, stall_after_s), sent_at = limits_s, _sent_at(m, now)
    if now - sent_at > timedelta(seconds=stale_after_s):
        log.info("ignoring a heartbeat of worker %s sent %.0fs ago (stale, or its clock is behind)",
                 m.worker_id, (now - sent_at).total_seconds())
        return False
    incarnation = m.incarnation
    started_at = datetime.fromtimestamp(m.started_at, UTC) if m.started_at else sent_at
    worker = session.get(Worker, m.worker_id, with_for_update={"key_share": True})
    # A draining worker's beats are not news (its drain is: below); a lost one's first beat is.
    is_new = worker is None or worker.state not in (states.WORKER_ALIVE, states.WORKER_DRAINING)
    if worker is None:
        worker = Worker(id=m.worker_id, registered_at=now, last_heartbeat=sent_at)
        session.add(worker)
    elif incarnation and worker.incarnation and incarnation != worker.incarnation:
        if worker.incarnation_started_at is not None and started_at < as_utc(worker.incarnation_started_at):
            return False  # from the process a newer one replaced
        # A new process under this id: the one before it is gone, and so are its packs.
        for pack in _running_packs(session, worker.id):
            lose_pack(session, pack, now, f"worker {worker.id} restarted (a new process took its place)", policy)
        is_new = True
    elif sent_at < as_utc(worker.last_heartbeat):
        return False  # older than one already applied (a replayed batch): it says nothing new
    if incarnation and incarnation != worker.incarnation:
        worker.incarnation, worker.incarnation_started_at = incarnation, started_at
    worker.queue = m.queue
    worker.device = m.device
    worker.memory_bytes = m.memory_bytes
    worker.max_slots = m.max_slots
    worker.free_memory_bytes = _count(m.free_memory_bytes, "free_memory_bytes", 0, INT64_MAX)
    # Its sampler let go of its model: the memory is the packs' again, worth a replan (a size that changes while it
    # holds one is read at the next round).
    sampler = _count(m.sampler_bytes, "sampler_bytes", 0, INT64_MAX)
    sampler_freed = bool(worker.sampler_bytes) and not sampler
    worker.sampler_bytes = sampler
    models, gpus = _models(m.models), _gpus(m.gpus)
    max_packs = _count(m.max_packs, "max_packs", 1, MAX_WORKER_PACKS) or 1
    # It can load other models now, or has more or less memory for a pack (its GPUs, its packs): worth a replan.
    models_changed, gpus_changed = models != worker.models, (gpus, max_packs) != (worker.gpus, worker.max_packs)
    if models_changed:
        worker.models = models
    if gpus_changed:
        worker.gpus, worker.max_packs = gpus, max_packs
    warm = _warm_models(m.warm_models)
    if warm != worker.warm_models:  # no replan: a tie-breaker of the planners, read at their next round
        worker.warm_models = warm
    worker.last_heartbeat = sent_at if is_new else max(as_utc(worker.last_heartbeat), sent_at)
    named = _named_packs(m)
    for pack_id, progressed_at in named:
        stall_s = stalled_s(pack_id, progressed_at, sent_at.timestamp(), stall_after_s)
        if stall_s is not None:
            return _stalled(session, worker, pack_id, stall_s, now, aborts, policy)
    # Draining on SIGTERM (worker/drain.py): the planners give it nothing (only alive workers are usable) while it
    # hands its trials back; a new process under its id (a restart) beats as alive again.
    drains = bool(m.draining)
    if drains and worker.state != states.WORKER_DRAINING:
        log.info("worker %s drains (it was told to stop): it gets no pack, its trials are handed back", worker.id)
        is_new = True  # who may get packs changed: worth a replan
    worker.state = states.WORKER_DRAINING if drains else states.WORKER_ALIVE
    if m.names_pack:  # what the process runs now (a report from before this field cannot be judged)
        is_new |= _check_named_packs(session, worker, {p for p, _ in named}, sent_at, now, aborts, policy)
    return is_new or models_changed or gpus_changed or sampler_freed


def _stalled(session: Session, worker: Worker, pack_id: str, stall_s: float, now: datetime,
             aborts: set[tuple[str, str]], policy: FaultPolicy) -> bool:
    """A beat whose pack made no progress for longer than LORAPLANE_WORKER_STALL_S: the process lives, its training
    hangs. The worker is lost while its beats say so (its one pack process is taken: the planners give it nothing),
    its live packs with it, and it is told to stop the pack (should it wake). True when it was alive until now."""
    aborts.add((worker.id, pack_id))
    was_alive = worker.state == states.WORKER_ALIVE
    if was_alive:
        log.warning("worker %s: pack %s made no progress for %.0fs; the worker is lost while it hangs", worker.id,
                    pack_id, stall_s)
    lose_worker(session, worker, now, f"pack {pack_id} made no progress for {stall_s:.0f}s on worker {worker.id} "
                                      "(its process beats, its training hangs)", policy)
    return was_alive


def _named_packs(m: WorkerHeartbeat) -> list[tuple[str, float | None]]:
    """The packs a beat names, each with when it last progressed (None: not said): its `packs` where it sends them
    (a worker running several), else its one `pack_id`. A malformed entry is logged and left out."""
    if m.packs is None:
        return [] if m.pack_id is None else [(m.pack_id, m.progressed_at)]
    named: list[tuple[str, float | None]] = []
    for entry in m.packs if isinstance(m.packs, list) else [m.packs]:
        pack_id = entry.get("pack_id") if isinstance(entry, dict) else None
        at = entry.get("progressed_at") if isinstance(entry, dict) else None
        if not isinstance(pack_id, str) or isinstance(at, bool) or not (at is None or isinstance(at, int | float)):
            log.warning("ignoring a heartbeat's pack entry that is not {pack_id, progressed_at}: %r", entry)
            continue
        named.append((pack_id, None if at is None else float(at)))
    return named


def _count(raw: Any, name: str, low: int, high: int) -> int | None:
    """A heartbeat's integer field within [low, high]; None when it does not say or says something else (logged:
    the beat still proves the worker alive)."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not low <= raw <= high:
        log.warning("ignoring a heartbeat's %s that is not a count from %d to %d: %r", name, low, high, raw)
        return None
    return raw


def _gpus(raw: Any) -> int:
    """The GPUs a heartbeat says its worker runs each pack over: 1 when it does not say (a worker from before this
    field). A malformed value is logged and taken as 1: the beat still proves the worker alive, and a bad field must
    not stop the batch (an integer beyond the column would fail its commit)."""
    if raw is None:
        return 1
    # bool is an int to Python, and 2.0 may be how a JSON encoder wrote 2; "2" is not a count.
    count = int(raw) if isinstance(raw, float) and raw.is_integer() else raw
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_WORKER_GPUS:
        log.warning("ignoring a heartbeat's gpus that is not a count from 1 to %d: %r", MAX_WORKER_GPUS, raw)
        return 1
    return count


def _models(raw: Any) -> list[str] | None:
    """The registered models a heartbeat says its worker can load, sorted; None when it does not say (a worker
    from before this field, or one that has not read the registry yet: taken as able to load every model)."""
    if raw is None:
        return None
    if not isinstance(raw, list):  # malformed: the beat still proves the worker alive, its models are unknown
        log.warning("ignoring a heartbeat's models that are not a list: %r", raw)
        return None
    return sorted({str(name) for name in raw})


def _warm_models(raw: Any) -> list[dict[str, Any]] | None:
    """The base models a heartbeat says its worker holds warm (worker/model_cache.py), in its order (most recently
    used first): each ``{"name", "revision", "bytes", "last_used_at"}``; None when it does not say (a worker from
    before this field). A malformed entry is logged and left out, a value that is not a list taken as not said: the
    beat still proves the worker alive."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        log.warning("ignoring a heartbeat's warm_models that are not a list: %r", raw)
        return None
    warm: list[dict[str, Any]] = []
    for entry in raw:
        try:
            name, revision = entry["name"], entry["revision"]
            size, used = entry["bytes"], entry["last_used_at"]
            if not (isinstance(name, str) and isinstance(revision, str) and isinstance(size, int)
                    and not isinstance(size, bool) and size >= 0 and isinstance(used, int | float)):
                raise TypeError("a field of the wrong type")
        except (KeyError, TypeError) as exc:
            log.warning("ignoring a heartbeat's warm model %r: %s", entry, exc)
            continue
        warm.append({"name": name, "revision": revision, "bytes": size, "last_used_at": float(used)})
    return warm


def _running_packs(session: Session, worker_id: str) -> list[Pack]:
    return list(session.scalars(
        select(Pack).where(Pack.worker_id == worker_id, Pack.state == states.PACK_RUNNING)
        .with_for_update(key_share=True)
    ).all())


def _check_named_packs(session: Session, worker: Worker, named: set[str], sent_at: datetime, now: datetime,
                       aborts: set[tuple[str, str]], policy: FaultPolicy) -> bool:
    """A running pack the worker no longer names (it crashed out of it, or its reports were lost) is lost;
    a pack it names that is over here is one it should stop. True when a pack was lost."""
    lost = False
    for pack in _running_packs(session, worker.id):
        # A beat sent before the pack started does not name it yet (the worker names a pack from before its
        # `pack.started` until after its last report).
        if pack.id not in named and (pack.started_at is None or sent_at > as_utc(pack.started_at)):
            lose_pack(session, pack, now, f"worker {worker.id} is no longer running pack {pack.id}", policy)
            lost = True
    for pack_id in sorted(named):
        over = session.get(Pack, pack_id)
        if over is not None and over.state not in states.PACK_LIVE:
            aborts.add((worker.id, over.id))
    return lost


def _from_pack_process(session: Session, m: PackReport) -> bool:
    """False for a report from a worker process other than the one that started the report's pack."""
    incarnation, pack_id = m.incarnation, m.pack_id
    if not incarnation or not pack_id:
        return True
    pack = session.get(Pack, pack_id)
    return pack is None or pack.incarnation is None or pack.incarnation == incarnation


def _live_trial(session: Session, trial_id: str, pack_id: str) -> Trial | None:
    # Locked, read fresh, by `lock_trials` at the batch's start (a trial the API cancels meanwhile must not come
    # back as completed), and held by `ingest`: read from the session (a locking read a report was a sixth of the
    # serial part of ingest at 256 workers).
    trial = session.get(Trial, trial_id)
    if trial is None or trial.pack_id != pack_id or trial.state != states.TRIAL_RUNNING:
        return None
    return trial


def _live_pack(session: Session, pack_id: str) -> Pack | None:
    pack = session.get(Pack, pack_id)
    return pack if pack is not None and pack.state in states.PACK_LIVE else None


def _pack_started(session: Session, m: PackStarted, now: datetime) -> set[str]:
    """Marks the pack running; returns its trials' tasks (a trial resumed only to export its best adapter is
    stopped as soon as it runs: the policy decides on a pack's start, not only on new validation points)."""
    pack = _live_pack(session, m.pack_id)
    if pack is None:
        return set()
    pack.state = states.PACK_RUNNING
    pack.started_at = pack.started_at or _sent_at(m, now)
    pack.incarnation = pack.incarnation or m.incarnation
    worker = session.get(Worker, pack.worker_id)
    if worker is not None:
        worker.current_pack_id = pack.id
    return set(session.scalars(select(Trial.task_id).where(Trial.id.in_(list(pack.trial_ids)))))


@dataclass
class PointBuffer:
    """Points of a batch's reports not yet stored, and the trials whose scores must be read again once they are
    (`score`, at the batch's end)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    curved: dict[str, Trial] = field(default_factory=dict)  # a new validation point: selection_loss scored again
    scored: dict[str, Trial] = field(default_factory=dict)  # a new "metric" point: metric_score read again

    def flush(self, session: Session) -> None:
        """Stores the points in one statement (a point sent twice counts once)."""
        if self.rows:
            # Without flushing the trials' new steps first: the insert needs none of them, and they go out once,
            # with the batch, instead of one UPDATE per trial and message.
            with session.no_autoflush:
                session.execute(_insert_ignoring_duplicates(session, self.rows))
        self.rows = []

    def score(self, session: Session) -> None:
        """Scores the trials that got new points again from their stored curves, once a batch's points are stored:
        nothing in a batch reads a score, and once per flush (each report after points) was a query a report, a
        quarter of the serial part of ingest at 256 workers (issue 53). A curve emptied meanwhile (a trial that
        restarts from step 0) is scored as it is stored."""
        for trial in self.scored.values():
            trial.metric_score = newest_metric_score(session, trial.id)
        for trial_id, loss in trial_selection_losses(session, list(self.curved)).items():
            self.curved[trial_id].selection_loss = loss
        self.curved, self.scored = {}, {}


def _points(session: Session, m: Points | TrialCheckpoint | TrialFinished, buffer: PointBuffer) -> set[str]:
    """Adds the message's points to ``buffer`` (stored by its `flush`); returns the tasks that got a validation
    point. A "metric" point (a trial's score on its task's generative metric, sent when it ends) is stored too and
    sets the trial's metric_score; it is no validation point (early exit reads train and val only)."""
    pack_id = m.pack_id
    validated: set[str] = set()
    rows: list[dict[str, Any]] = []
    trials: dict[str, Trial | None] = {}
    scored: dict[str, Trial] = {}
    curved: dict[str, Trial] = {}
    diverged: dict[str, int] = {}  # trial -> its points left out of this message for a non-finite loss
    for trial_id, step, split, loss in m.points:
        if trial_id not in trials:
            trials[trial_id] = _reporting_trial(session, trial_id, pack_id)
        trial = trials[trial_id]
        if trial is None or (split != METRIC_SPLIT and trial.state != states.TRIAL_RUNNING):
            continue
        if split == METRIC_SPLIT and not 0.0 <= loss <= 1.0:  # a share of rows (NaN fails too): it would mis-rank
            log.warning("dropping trial %s's metric score %r at step %s: not in [0, 1]", trial_id, loss, step)
            continue
        if not math.isfinite(loss):
            # A diverged trial's NaN or infinite loss: no curve may hold it (SQLite stores NaN as NULL, which the
            # column refuses: the batch would fail for ever), and it ranks as nothing.
            diverged[trial_id] = diverged.get(trial_id, 0) + 1
            continue
        rows.append({"trial_id": trial_id, "step": step, "split": split, "loss": loss})
        if split == "train" and step >= trial.steps_done:
            trial.steps_done = step
            trial.last_train_loss = loss
        elif split == "val":
            validated.add(trial.task_id)
            curved[trial_id] = trial
            if trial.best_val_loss is None or loss < trial.best_val_loss:
                trial.best_val_loss, trial.best_step = loss, step
        elif split == METRIC_SPLIT:
            scored[trial_id] = trial
    for trial_id, n in diverged.items():  # one line per trial and message, not one per point
        log.warning("dropping %d point(s) of trial %s: their loss is not finite (diverged)", n, trial_id)
    # The whole message or none of it: a malformed one raises above, before anything is buffered.
    buffer.rows += rows
    buffer.curved.update(curved)
    buffer.scored.update(scored)
    return validated


def _reporting_trial(session: Session, trial_id: str, pack_id: str) -> Trial | None:
    """The trial, when its points from this pack count: running in it, or ended in it (a metric score comes when
    a trial ends, also one stopped early whose best adapter its worker exported). `lock_trials` locked it for the
    batch (every point's trial), and `ingest` holds it: read from the session."""
    trial = session.get(Trial, trial_id)
    if trial is None or trial.pack_id != pack_id or trial.state not in _REPORTING_STATES:
        return None
    return trial


_REPORTING_STATES = (states.TRIAL_RUNNING, states.TRIAL_COMPLETED, states.TRIAL_STOPPED_EARLY)


# The points of one message as four arrays, one statement whatever their number: compiled once and cached. A
# multi-row VALUES insert built by SQLAlchemy compiled four bind parameters per point on every message, which was
# most of ingest's time (40% at 500 points a message; benchmarks/ingest.py, issue 53).
_INSERT_POINTS_PG = text(
    "INSERT INTO metric_points (trial_id, step, split, loss, created_at) "
    "SELECT u.trial_id, u.step, u.split, u.loss, :created_at FROM unnest(CAST(:trial_ids AS varchar[]), "
    "CAST(:steps AS integer[]), CAST(:splits AS varchar[]), CAST(:losses AS double precision[])) "
    "AS u(trial_id, step, split, loss) ON CONFLICT ON CONSTRAINT uq_metric_points_trial_step_split DO NOTHING")


def _insert_ignoring_duplicates(session: Session, rows: list[dict[str, Any]]) -> Any:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return _INSERT_POINTS_PG.bindparams(
            trial_ids=[r["trial_id"] for r in rows], steps=[r["step"] for r in rows],
            splits=[r["split"] for r in rows], losses=[r["loss"] for r in rows], created_at=utcnow())
    if dialect == "sqlite":
        return sqlite.insert(MetricPoint).values(rows).on_conflict_do_nothing(
            index_elements=["trial_id", "step", "split"]
        )
    return insert(MetricPoint).values(rows)


def _trial_checkpoint(session: Session, m: TrialCheckpoint) -> None:
    trial = _live_trial(session, m.trial_id, m.pack_id)
    if trial is not None and m.step >= (trial.checkpoint_step or 0):
        trial.checkpoint_key, trial.checkpoint_step = m.checkpoint_key, m.step


def _checkpoint_saved(session: Session, m: CheckpointSaved) -> None:
    """A trial's adapter checkpoint is stored (a report replayed after a crash finds its row and leaves it), and
    the ones its worker no longer keeps are gone. Recorded for a trial in any state: the file is there."""
    trial = session.get(Trial, m.trial_id)
    if trial is None:
        return
    if m.dropped_steps:
        session.execute(delete(Checkpoint).where(Checkpoint.trial_id == trial.id,
                                                 Checkpoint.step.in_(m.dropped_steps)))
    values = {"trial_id": trial.id, "task_id": trial.task_id, "tenant_id": trial.tenant_id, "step": m.step,
              "epoch": m.epoch, "epoch_end": m.epoch_end, "adapter_key": m.adapter_key, "size_bytes": m.size_bytes,
              "val_loss": m.val_loss if m.val_loss is None or math.isfinite(m.val_loss) else None}
    existing = session.scalar(select(Checkpoint).where(Checkpoint.trial_id == trial.id, Checkpoint.step == m.step))
    if existing is None:
        session.add(Checkpoint(**values))
    else:  # the step written again (a trial resumed from before it): the newer file is the one at its key
        for name, value in values.items():
            setattr(existing, name, value)


def _trial_checkpoint_lost(session: Session, m: TrialCheckpointLost) -> None:
    """The worker could not find the checkpoint the trial was to resume from: it trains from step 0, so its
    stored curve and checkpoint go (the new run's points replace them)."""
    trial = _live_trial(session, m.trial_id, m.pack_id)
    if trial is None:
        return
    session.execute(delete(MetricPoint).where(MetricPoint.trial_id == trial.id))
    trial.checkpoint_key, trial.checkpoint_step = None, None
    trial.steps_done, trial.best_val_loss, trial.best_step, trial.last_train_loss = 0, None, None, None
    trial.metric_score, trial.selection_loss = None, None
    record_event(
        session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id, type="trial.restarted",
        level="warn", message=f"trial {trial.index} starts again from step 0: its checkpoint "
                              f"{m.checkpoint_key} was gone",
        data={"checkpoint_key": m.checkpoint_key},
    )


def _trial_admitted(session: Session, m: TrialAdmitted) -> set[str]:
    """A back-fill joined its pack; returns its task (as `_pack_started`)."""
    trial = _live_trial(session, m.trial_id, m.pack_id)
    if trial is None:
        return set()
    trial.awaiting_admission = False
    return {trial.task_id}


def _trial_rejected(session: Session, m: TrialRejected, now: datetime) -> bool:
    """A back-fill its pack could not take: pending again. The attempt is spent when the worker tried and failed to
    admit it (its files or checkpoint could not be read, its rank or layers do not fit the pack: a trial that cannot
    be admitted anywhere fails after its attempts); not when the pack was ending (scheduler/service/faults.py)."""
    trial = _live_trial(session, m.trial_id, m.pack_id)
    if trial is None or not trial.awaiting_admission:
        return False
    reason = m.reason or "refused"
    refund = reason == BACKFILL_NOT_JOINED
    if refund:  # the pack is ending: it takes no more back-fills (capacity None: none)
        pack = session.get(Pack, m.pack_id)
        if pack is not None:
            pack.capacity = None
    requeue_trial(session, trial, f"pack {m.pack_id} did not take it: {reason}",
                  blame="none" if refund else "trial", now=now)
    return True


def _pack_progress(session: Session, m: PackProgress) -> None:
    pack = _live_pack(session, m.pack_id)
    if pack is not None:
        progress = m.model_dump(include={"steps", "step_s", "tokens", "slots"}, exclude_none=True)
        Progress.from_report(progress)  # an implausible report is dropped here, not when the planner reads it
        pack.progress = progress


def _pack_profile(session: Session, m: PackProfile) -> None:
    pack = session.get(Pack, m.pack_id)
    if pack is not None:
        pack.profile = m.profile


def _trial_finished(session: Session, m: TrialFinished, now: datetime, touched: set[str],
                    policy: FaultPolicy) -> bool:
    status = m.status
    _record_usage(session, m, now)
    trial = _live_trial(session, m.trial_id, m.pack_id)
    if trial is None:
        _stopped_early_adapter(session, m)
        return False
    touched.add(trial.task_id)
    if status == "paused":
        _trial_paused(session, trial, m)
        return True
    if status not in ("completed", "stopped"):
        # Its own failure (an exception in its step or set-up, its data, its OOM): one attempt spent; again from
        # its checkpoint until they are all spent (an OOM may not recur in another pack).
        requeue_trial(session, trial, m.error or "unknown error", blame="trial", now=now, policy=policy)
        return True
    trial.finished_at = now
    trial.steps_done = m.steps_done or trial.steps_done
    if m.final_train_loss is not None and math.isfinite(m.final_train_loss):
        trial.last_train_loss = m.final_train_loss
    if status == "completed":
        trial.state = states.TRIAL_COMPLETED
        # A diverged trial's NaN is no best: it ranks after every trial with a loss.
        trial.best_val_loss = m.best_val_loss if m.best_val_loss is None or math.isfinite(m.best_val_loss) else None
        trial.best_step = m.best_step
        trial.adapter_key = m.adapter_key
        loss = "n/a" if trial.best_val_loss is None else f"{trial.best_val_loss:.4f}"
        message = f"trial {trial.index} completed after {trial.steps_done} steps (best validation loss {loss})"
        level = "info"
    elif status == "stopped":
        # Only the scheduler asks a worker to stop a trial; it already moved the trial to its final state.
        trial.state = states.TRIAL_CANCELLED
        trial.stop_reason = trial.stop_reason or "stopped"
        message, level = f"trial {trial.index} stopped", "info"
    record_event(
        session,
        tenant_id=trial.tenant_id,
        task_id=trial.task_id,
        trial_id=trial.id,
        type=f"trial.{trial.state}",
        level=level,
        message=message,
        data={"best_val_loss": trial.best_val_loss, "best_step": trial.best_step, "steps": trial.steps_done},
    )
    return True


def _record_usage(session: Session, m: TrialFinished, now: datetime) -> None:
    """What the trial trained in this pack (a worker before usage accounting sends no `pack_tokens`): counted even
    when the report itself is stale for the trial's state (a trial stopped while its pack still trained it), as the
    GPU time was spent; once per (pack, trial, step), so a replayed report is not counted twice. Not from a lost pack
    (its process may train on, unheard, after it was declared lost): its trials went back to pending and train those
    steps again elsewhere, where they are counted."""
    if m.pack_tokens is None:
        return
    pack = session.get(Pack, m.pack_id)
    if pack is not None and pack.state == states.PACK_LOST:
        return
    trial = session.get(Trial, m.trial_id)
    key = (m.pack_id, m.trial_id, m.steps_done or 0)
    if trial is None or session.scalar(select(TrialUsage.id).where(
            TrialUsage.pack_id == key[0], TrialUsage.trial_id == key[1], TrialUsage.end_step == key[2])) is not None:
        return
    session.add(TrialUsage(pack_id=key[0], trial_id=trial.id, task_id=trial.task_id, tenant_id=trial.tenant_id,
                           tokens=m.pack_tokens, steps=m.pack_steps or 0, end_step=key[2],
                           created_at=now))


def _trial_paused(session: Session, trial: Trial, m: TrialFinished) -> None:
    """Out of its pack at its warm-up boundary, checkpointed (the `trial.checkpoint` came first): it waits,
    holding no slot, for its task's warm-up ranking. Preempted for another tenant (scheduler/service/fairness.py),
    it is pending again instead, held back until that tenant's trials start; handed back by a worker that drains on
    SIGTERM (``drained``, worker/drain.py), it is pending again at once. Pausing is not a failure: the attempt is not
    counted."""
    trial.pack_id = None
    trial.attempts = max(0, trial.attempts - 1)
    trial.steps_done = m.steps_done or trial.steps_done
    at = f"checkpointed at step {trial.checkpoint_step}" if trial.checkpoint_step else "no checkpoint yet"
    if m.drained and trial.preempted_for is None:
        trial.state = states.TRIAL_PENDING
        record_event(
            session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id, type="trial.paused",
            message=f"trial {trial.index} paused at step {trial.steps_done}: its worker {m.worker_id} is shutting "
                    f"down ({at}); it is pending again and resumes from its checkpoint",
            data={"steps": trial.steps_done, "checkpoint_step": trial.checkpoint_step, "drained": True,
                  "worker_id": m.worker_id},
        )
        return
    if trial.preempted_for is not None:
        trial.state = states.TRIAL_PENDING
        record_event(
            session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id, type="trial.paused",
            message=f"trial {trial.index} paused at step {trial.steps_done} for tenant {trial.preempted_for}'s "
                    f"waiting trials ({at}); it is pending again and resumes from its checkpoint",
            data={"steps": trial.steps_done, "checkpoint_step": trial.checkpoint_step,
                  "for_tenant": trial.preempted_for},
        )
        return
    trial.state = states.TRIAL_WAITING
    record_event(
        session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id, type="trial.waiting",
        message=f"trial {trial.index} reached its warm-up boundary at step {trial.steps_done}; its slot is free "
                f"while the rest of the task warms up ({at})",
        data={"steps": trial.steps_done, "checkpoint_step": trial.checkpoint_step},
    )


def _stopped_early_adapter(session: Session, m: TrialFinished) -> None:
    """A trial the scheduler stopped early for overfitting reports from its pack with its best adapter saved."""
    trial = session.get(Trial, m.trial_id, with_for_update={"key_share": True})
    if (trial is None or trial.pack_id != m.pack_id or trial.state != states.TRIAL_STOPPED_EARLY
            or not m.adapter_key or trial.adapter_key):
        return
    trial.adapter_key = m.adapter_key
    trial.best_val_loss, trial.best_step = m.best_val_loss, m.best_step
    record_event(
        session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id, type="trial.adapter_saved",
        message=f"trial {trial.index}: its best adapter (step {trial.best_step}) was saved before it stopped",
        data={"best_val_loss": trial.best_val_loss, "best_step": trial.best_step},
    )


def _pack_ended(session: Session, m: PackFinished | PackFailed, now: datetime, policy: FaultPolicy) -> None:
    """The pack's end. Trials it did not report on are not to blame for that: a pack that failed as a whole (its
    model or files would not load, the store could not be written) or ended without reporting them ends by its
    worker's doing, so they go back to pending at no attempt's cost and the worker is charged (a model no worker can
    load ends its trials at the loss bound, with the error; scheduler/service/faults.py). A back-fill it never took
    goes back to pending; a pack that ended well clears its worker's run of quarantines."""
    pack = _live_pack(session, m.pack_id)
    if pack is None:
        return
    pack.state = states.PACK_FINISHED
    pack.finished_at = now
    stranded = session.scalars(
        select(Trial).where(Trial.pack_id == pack.id, Trial.state == states.TRIAL_RUNNING).order_by(Trial.id)
    ).all()
    if isinstance(m, PackFailed) or any(not t.awaiting_admission for t in stranded):
        why = (f"pack {pack.id} failed on worker {pack.worker_id}: {m.error or 'unknown error'}"
               if isinstance(m, PackFailed) else f"pack {pack.id} ended without reporting this trial")
        log.warning("%s", why)
        requeue_for_worker(session, pack, now, why, policy)
        return
    worker = session.get(Worker, pack.worker_id)
    if worker is not None and worker.current_pack_id == pack.id:
        worker.current_pack_id = None
    for trial in stranded:
        requeue_trial(session, trial, f"pack {pack.id} ended before it could join", blame="none", now=now,
                      policy=policy)
    credit_worker(session, pack.worker_id)


def _pack_refused(session: Session, m: PackRefused, now: datetime, policy: FaultPolicy) -> bool:
    """The worker did not start the pack (worker/colocation.py): nothing of it ran, so its trials wait again with no
    attempt spent and no blame; the worker's next beats say how much memory it has left. True: replan."""
    pack = _live_pack(session, m.pack_id)
    if pack is None:
        return False
    log.warning("worker %s refused pack %s: %s", pack.worker_id, pack.id, m.reason)
    pack.state, pack.finished_at = states.PACK_REFUSED, now
    for trial in session.scalars(
        select(Trial).where(Trial.pack_id == pack.id, Trial.state == states.TRIAL_RUNNING).order_by(Trial.id)
    ).all():
        requeue_trial(session, trial, f"worker {pack.worker_id} had no room for pack {pack.id}: {m.reason}",
                      blame="none", now=now, policy=policy)
    return True
