"""The scheduler daemon: thin loops around ingest, and reap -> finalize -> plan -> dispatch (a round). On PostgreSQL
ingest runs on a thread of its own and wakes the rounds; on SQLite (one writer) the two take turns in one loop.

Every round replans (CP-SAT by default, scheduler/planning/placement.py) when trials wait and a worker is idle, so
a task submitted, a trial or pack finished, a worker joined or lost (each one a message or a heartbeat's
absence) all lead to a new plan within one round.

It wakes on every bus message (worker reports, API wake-ups) and at least every `scheduler_tick_s`, so
a lost wake-up only delays it. Every decision is read from and written to the database first; the bus
and Celery only carry what was already committed.

Each round also keeps the model registry published on the bus, for workers to say in their heartbeats which
models they can load; a task whose model no live worker can load waits, told so by one event. And after the plan,
each task whose pending trials still wait is told why (behind which pack, which model, its place in the queue, an
estimated start): its `waiting` field, and a `task.waiting` event when that is news (scheduler/service/waits.py).
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy import or_, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from common import states
from common.bus import REGISTRY_KEY, SCHEDULER_GROUP, SCHEDULER_STREAM, Bus, commands_stream
from common.db import get_engine, session_scope
from common.messages import AbortPack, AdmitTrials, Points, Report, StopTrials, parse_report
from common.registry import published_registry
from common.settings import Settings
from common.tables import Pack, Task, utcnow
from scheduler.planning.cost import ModelCost
from scheduler.planning.fairness import policy_from
from scheduler.planning.placement import place
from scheduler.planning.types import Plan, PlanResult, Snapshot
from scheduler.service.cluster_state import MembersRead
from scheduler.service.dispatch import send_pack, trial_payload
from scheduler.service.exits import PauseRequest, apply_early_exit, placement
from scheduler.service.fairness import pause_requests, preempt_for_waiting, release_held
from scheduler.service.faults import fault_policy, reap_lost_workers
from scheduler.service.ingest import ingest
from scheduler.service.planner_io import (
    admission_requests,
    build_snapshot,
    busy_workers,
    live_packs,
    load_costs,
    note_model_waits,
    record_plan,
    stop_requests,
)
from scheduler.service.task_results import finalize_tasks
from scheduler.service.telemetry import SchedulerTelemetry, message_dropped
from scheduler.service.trackers import TrackerSync
from scheduler.service.waits import note_task_waits
from scheduler.service.webhooks import WebhookSender

log = logging.getLogger(__name__)

LEADER_LOCK_ID = 0x10_4A_91_A7  # pg advisory lock key: one active scheduler per database
LEADER_POLL_S = 0.5  # how often a standby tries the lock: it takes over within this of the active one's death
BATCH = 1000  # reports read at once (applied in `scheduler_ingest_threads` transactions, by worker)
INGEST_BUDGET_S = 1.0  # a round reads batches while they come full for this long (or the last plan's time), then plans
REGISTRY_REPUBLISH_S = 60.0  # the model registry is published again this often even when it did not change


def _points_first(reports: list[Report]) -> tuple[list[Points], list[Report]]:
    """(the Points reports each worker sent before any other report of its in ``reports``, the rest in order)."""
    first: list[Points] = []
    rest: list[Report] = []
    changed: set[str] = set()  # workers that sent another report already
    for report in reports:
        if isinstance(report, Points) and report.worker_id not in changed:
            first.append(report)
        else:
            rest.append(report)
            if worker := getattr(report, "worker_id", None):
                changed.add(worker)
    return first, rest


def _conflict(exc: DBAPIError) -> bool:
    """A deadlock or serialisation failure: the database undid one of two transactions that met (the ingest
    thread's and a round's), which is tried again at once."""
    return getattr(exc.orig, "sqlstate", None) in ("40P01", "40001")


class _Retry:
    """A loop's attempt that failed is logged and tried again, backing off (by ``tick_s``) while failures repeat;
    ``on_outage`` runs after the database was away."""

    def __init__(self, stop: threading.Event, tick_s: float, on_outage: Callable[[], None]) -> None:
        self.stop, self.tick_s, self.on_outage, self.failures = stop, tick_s, on_outage, 0

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        try:
            yield
            self.failures = 0
        except DBAPIError as exc:
            if _conflict(exc):
                log.info("the %s met another transaction (%s); trying again", what, str(exc).splitlines()[0])
                return
            # The database is away: nothing was acked, so nothing is lost. Wait it out, backing off.
            self.failures += 1
            log.warning("the database is unreachable (%s); retrying", str(exc).splitlines()[0])
            self.stop.wait(min(10.0, self.tick_s * self.failures))
            # The reports that piled up meanwhile come first, oldest first (the unacked batch again): workers are
            # not judged before their newest heartbeats could be read.
            self.on_outage()
        except Exception:
            self.failures += 1
            log.exception("scheduler %s failed; retrying", what)
            self.stop.wait(min(10.0, self.tick_s * self.failures))


class SchedulerDaemon:
    def __init__(self, settings: Settings, bus: Bus, celery: Celery, consumer: str = "scheduler") -> None:
        self.settings = settings
        self.faults = fault_policy(settings)  # who pays for a failure (scheduler/service/faults.py)
        self.bus = bus
        self.celery = celery
        self.consumer = consumer
        self._stops_sent: set[tuple[str, str, str]] = set()  # (pack, trial, placement)
        self._admits_sent: set[tuple[str, str]] = set()
        self._pauses: deque[PauseRequest] = deque()  # decided, committed, not yet sent
        self.fairness = policy_from(settings) if settings.preempt else None  # preemption (None: off)
        self._aborts: set[tuple[str, str]] = set()  # (worker, pack): packs a worker runs that are over here
        self._aborts_sent: set[tuple[str, str]] = set()
        self._bus_resets = bus.resets
        self._reap_after = 0.0  # monotonic time before which silent workers are not declared lost
        self._registry_sent: dict[str, Any] | None = None  # the model registry last published, and when
        self._registry_sent_at = 0.0
        self.telemetry = SchedulerTelemetry(enabled=False)  # `run` serves it when a metrics port is set
        self._ingest_threads = 1 if get_engine().dialect.name == "sqlite" else settings.scheduler_ingest_threads
        self._ingest_pool = ThreadPoolExecutor(self._ingest_threads, thread_name_prefix="ingest")
        self._last_tick_s = 0.0
        # Between the ingest thread and the rounds (`run`): whether this scheduler leads, whether something arrived
        # since the last round, and whether ingest has read all there was (heartbeats too).
        self._leading = threading.Event()
        self._wake = threading.Event()
        self._caught_up = False
        self._handover = threading.Lock()  # guards what ingest hands the rounds to send: `_aborts`, `_pauses`

    def step(self, block_s: float) -> int:
        """One round: ingest what arrived (waiting up to block_s for the first batch), then act. Returns messages
        handled.

        Ingest reads batch after batch while the stream holds a full one, for up to INGEST_BUDGET_S: at one batch a
        round, a round's planning time capped what could be read (at 256 hollow workers the stream fell minutes
        behind; benchmarks/cluster_scale.py). The round's own work (reaping, planning, dispatch) does not depend on
        the bus: when Redis is away the read fails, and the round still reaps and plans from the database."""
        # At least as long as the last round's planning took: ingest gets half the time or more while it is behind.
        deadline = time.monotonic() + max(INGEST_BUDGET_S, self._last_tick_s)
        handled = last = self._ingest_batch(block_s)
        while last == BATCH and time.monotonic() < deadline:
            last = self._ingest_batch(0.0)
            handled += last
        # A full batch means heartbeats may still wait behind it: no one is declared lost before they are read.
        self._timed_tick(caught_up=last < BATCH)
        return handled

    def _timed_tick(self, caught_up: bool) -> None:
        """A round (`tick`), reaping only once ingest has read all there was, timed for the next one's budget."""
        started = time.monotonic()
        self.tick(reap=caught_up and time.monotonic() >= self._reap_after)
        self._last_tick_s = time.monotonic() - started

    def _ingest_batch(self, block_s: float) -> int:
        """Reads up to BATCH reports and applies them (`_points_first`, `_shards`); returns how many were read."""
        try:
            batch = self.bus.consume(SCHEDULER_STREAM, SCHEDULER_GROUP, self.consumer, count=BATCH, block_s=block_s)
        except Exception as exc:  # noqa: BLE001 - the bus is away: work from the database, read again later
            log.warning("could not read the bus (%s); this round goes on without it", exc)
            batch = []
            # No heartbeat can arrive while the bus is away, so silence proves nothing until the workers had a
            # full timeout to be heard again.
            self._hold_reaping()
        if self.bus.resets != self._bus_resets:
            # The bus came back empty: commands sent before may never have been read. Send them again (the
            # worker takes each stop and each admission once).
            self._bus_resets = self.bus.resets
            self._stops_sent.clear()
            self._admits_sent.clear()
            self._aborts_sent.clear()
            self._registry_sent = None  # and the registry it held for workers
        if not batch:
            return 0
        # A message that cannot be read is logged, counted and left out, and acked with the rest: read again it
        # would fail again.
        reports = [r for _, raw in batch if (r := parse_report(raw, on_drop=message_dropped)) is not None]
        # The loss points a worker sent before any other report of its in the batch go first, by worker in
        # transactions of their own at once (most of a batch's volume, and they write no events); then everything
        # else in one transaction, in stream order. Each worker's reports are so applied in the order it sent them:
        # a point it sent after a state change (its trial ended, its pack was lost) is judged after that change.
        points, rest = _points_first(reports)
        shards = [self._ingest_pool.submit(self._ingest_shard, shard) for shard in self._shards(points)]
        wait(shards)  # every shard ends before a failure is raised: a replay must not meet one still running
        touched: set[str] = set()
        for shard in shards:
            touched |= shard.result()[0]  # points abort nothing
        if rest:
            rest_touched, aborts = self._ingest_shard(rest)
            touched |= rest_touched
            with self._handover:
                self._aborts |= aborts
        # Early exit on every new evaluation, once the points it rests on are stored (a crash in between replays the
        # batch: its points change nothing twice, and the same tasks are judged again).
        if touched:
            with session_scope() as session:
                pauses = apply_early_exit(session, touched, utcnow())
            with self._handover:
                self._pauses.extend(pauses)
        self.telemetry.ingested(reports)
        # Acked only after the commits: a crash in between replays the batch, and ingest is idempotent.
        try:
            self.bus.ack(SCHEDULER_STREAM, SCHEDULER_GROUP, [msg_id for msg_id, _ in batch])
        except Exception as exc:  # noqa: BLE001 - unacked messages come back and change nothing twice
            log.warning("could not ack %d messages (%s); they will be read again", len(batch), exc)
        return len(batch)

    def _shards(self, reports: list[Points]) -> list[list[Points]]:
        """The reports split by worker, in stream order within each: different workers' points are of different
        trials (each trial runs in one pack, each pack on one worker), so their transactions do not wait for each
        other."""
        shards: list[list[Points]] = [[] for _ in range(self._ingest_threads)]
        for report in reports:
            shards[zlib.crc32(report.worker_id.encode()) % len(shards)].append(report)
        return [shard for shard in shards if shard]

    def _ingest_shard(self, reports: Sequence[Report]) -> tuple[set[str], set[tuple[str, str]]]:
        """Reports applied in a transaction of their own; the tasks touched and the packs to abort."""
        touched: set[str] = set()
        aborts: set[tuple[str, str]] = set()
        with session_scope() as session:
            ingest(session, reports, touched=touched, stale_after_s=self.settings.worker_timeout_s, aborts=aborts,
                   policy=self.faults)
        return touched, aborts

    def tick(self, reap: bool = True) -> None:
        now = utcnow()
        timeout = self.settings.worker_timeout_s
        with session_scope() as session:
            for worker_id in reap_lost_workers(session, now, timeout, self.faults) if reap else []:
                log.warning("worker %s lost (no heartbeat for %.0fs)", worker_id, timeout)
            finalize_tasks(session, now)
            self._publish_registry(session)
            release_held(session, now)
            snapshot = build_snapshot(session, now, timeout)
            note_model_waits(session, snapshot.pending, now, timeout)
            waiting_models = {t.base_model for t in snapshot.pending}
            plan_started, replanned = time.perf_counter(), True
            # The running packs with room are read once, with the costs that predict their ends: they decide
            # whether to plan at all and go into the plan (read twice, they were a tenth of a round at 256 workers).
            costs = load_costs(session) if snapshot.pending else None
            read: MembersRead = {}  # running packs' members, read once before the plan changes them
            room = live_packs(session, costs, now, read) if costs is not None else ()
            if snapshot.pending and (any(w.models is None or not w.models.isdisjoint(waiting_models)
                                         for w in snapshot.idle_workers) or room):
                assert costs is not None
                snapshot = replace(snapshot, busy_workers=busy_workers(session, now, timeout, costs, read),
                                   live_packs=room)
                placement = place(snapshot, costs, solver=self.settings.planner,
                                  time_limit_s=self.settings.planner_time_limit_s)
                new_packs = record_plan(session, placement.plan, now, placement.result, costs)
                plan, result = placement.plan, placement.result
            else:
                new_packs, replanned = [], False
                plan, result = Plan(), None
            if self.fairness is not None and snapshot.pending:
                # What the plan could not place may take a running pack's worker (its members pause and resume).
                for pack_id in preempt_for_waiting(session, snapshot, plan, now, self.fairness):
                    log.info("preempting pack %s for waiting trials of another tenant", pack_id)
            self._note_waits(session, snapshot, plan, result, now, costs)
            if replanned:
                self.telemetry.replanned(time.perf_counter() - plan_started)
            self.telemetry.observe_state(session, now)
        for pack_id in new_packs:
            log.info("planned pack %s", pack_id)
        # Each send is retried next round when it fails (the broker or the bus is away): one failing must not
        # hold back the others.
        sends = {"dispatch": lambda: self._dispatch(now), "admissions": self._send_admissions,
                 "stops": self._send_stops, "aborts": self._send_aborts}
        for what, send in sends.items():
            try:
                send()
            except Exception as exc:  # noqa: BLE001
                log.warning("sending %s failed (%s); retrying next round", what, exc)

    def _note_waits(self, session: Session, snapshot: Snapshot, plan: Plan, result: PlanResult | None,
                    now: datetime, costs: dict[str, ModelCost] | None) -> None:
        """Why each task's pending trials still wait (scheduler/service/waits.py), in a savepoint: a failure to
        explain must not undo the plan it explains."""
        try:
            with session.begin_nested():
                note_task_waits(session, snapshot, plan, result, now, self.settings.worker_timeout_s, costs)
        except Exception:  # noqa: BLE001 - logged; the next round judges again
            log.exception("could not record why tasks wait; the plan stands")

    def _publish_registry(self, session: Session) -> None:
        """Publishes the model registry for workers (`REGISTRY_KEY`): at start, whenever it changed, and every
        `REGISTRY_REPUBLISH_S` besides (an emptied Redis forgets it). Each worker's heartbeat names the models of
        it that the worker can load. A bus that is away is tried again next round."""
        registry = {"models": published_registry(session)}
        if registry == self._registry_sent and time.monotonic() - self._registry_sent_at < REGISTRY_REPUBLISH_S:
            return
        try:
            self.bus.put(REGISTRY_KEY, registry)
        except Exception as exc:  # noqa: BLE001 - workers keep the registry they read last
            log.warning("could not publish the model registry (%s); retrying next round", exc)
            return
        if registry != self._registry_sent:
            log.info("published the model registry: %s", ", ".join(registry["models"]) or "no model")
        self._registry_sent, self._registry_sent_at = registry, time.monotonic()

    def _dispatch(self, now: datetime) -> None:
        """Sends new packs, and re-sends packs a worker never started (lost message, scheduler restart)."""
        stale = now - timedelta(seconds=self.settings.worker_timeout_s)
        sent: set[str] = set()
        with session_scope() as session:
            while True:
                # One pack at a time under its row lock, skipped by anyone else holding it: two schedulers
                # acting at once (a leader lock lost in a network split) still send each pack once.
                pack = session.scalars(
                    select(Pack)
                    .where(
                        or_(
                            Pack.state == states.PACK_PLANNED,
                            (Pack.state == states.PACK_DISPATCHED) & (Pack.dispatched_at < stale),
                        ),
                        Pack.id.not_in(sent),
                    )
                    .order_by(Pack.created_at, Pack.id)
                    .limit(1)
                    .with_for_update(skip_locked=True, key_share=True)
                ).first()
                if pack is None:
                    break
                send_pack(self.celery, session, pack)
                pack.state = states.PACK_DISPATCHED
                pack.dispatched_at = utcnow()
                log.info("dispatched pack %s to %s", pack.id, pack.worker_id)
                sent.add(pack.id)
                session.commit()

    def _send_admissions(self) -> None:
        """Sends each back-fill to its pack's worker once per scheduler process (a restarted scheduler sends
        the unconfirmed ones again; the worker takes each trial once)."""
        with session_scope() as session:
            requests = admission_requests(session)
            messages = []
            for pack_id, (worker_id, trials) in requests.items():
                fresh = [t for t in trials if (pack_id, t.id) not in self._admits_sent]
                if fresh:
                    payloads = [trial_payload(t, session.get_one(Task, t.task_id)) for t in fresh]
                    messages.append((pack_id, worker_id, payloads))
        for pack_id, worker_id, payloads in messages:
            self.bus.publish(commands_stream(worker_id), AdmitTrials(pack_id=pack_id, trials=payloads).to_dict())
            self._admits_sent.update((pack_id, p.trial_id) for p in payloads)

    def _send_stops(self) -> None:
        with session_scope() as session:
            requests = stop_requests(session)
            pauses = pause_requests(session)
        with self._handover:
            self._pauses.extend(pauses)
        for (pack_id, mode), (worker_id, trials) in requests.items():
            fresh = [(t.id, placement(t)) for t in trials if (pack_id, t.id, placement(t)) not in self._stops_sent]
            if not fresh:
                continue
            stop = StopTrials(pack_id=pack_id, trial_ids=[t for t, _ in fresh], mode=mode)
            self.bus.publish(commands_stream(worker_id), stop.to_dict())
            self._stops_sent.update((pack_id, t, placed) for t, placed in fresh)
        # Holds at the warm-up boundary and preemptions: checkpoint and free the slot (once per scheduler process; a
        # warm-up pause lost to a restart is decided again at the trial's next validation point, a preemption at
        # the next round, once its `preempted_for` is cleared).
        while self._pauses:
            pause = self._pauses[0]
            key = (pause.pack_id, pause.trial_id, pause.placed_at)
            if key not in self._stops_sent:
                stop = StopTrials(pack_id=pause.pack_id, trial_ids=[pause.trial_id], mode="pause")
                self.bus.publish(commands_stream(pause.worker_id), stop.to_dict())
                self._stops_sent.add(key)
            with self._handover:
                self._pauses.popleft()

    def _send_aborts(self) -> None:
        """Tells workers to stop packs that are over here (declared lost while the worker could not report)."""
        with self._handover:
            aborts = sorted(self._aborts - self._aborts_sent)
        for worker_id, pack_id in aborts:  # a failed send raises: what was not sent goes next round
            self.bus.publish(commands_stream(worker_id), AbortPack(pack_id=pack_id).to_dict())
            self._aborts_sent.add((worker_id, pack_id))
        with self._handover:
            self._aborts -= self._aborts_sent

    def _hold_reaping(self) -> None:
        """No worker is declared lost for one worker timeout: its heartbeats may not have been readable."""
        self._reap_after = time.monotonic() + self.settings.worker_timeout_s

    def run(self, stop: threading.Event) -> None:
        # Served from the start, a standby too (its gauges stay empty until it leads).
        self.telemetry = SchedulerTelemetry.start(self.settings)
        lock = self._acquire_leadership(stop)
        # Webhooks go out from the active scheduler (`up` and `loraplane scheduler` alike), on their own thread: a
        # slow receiver never holds up a round (scheduler/service/webhooks.py).
        threading.Thread(target=WebhookSender().run, args=(stop,), name="webhooks", daemon=True).start()
        # Experiment trackers likewise: a tracker that is down falls behind, scheduling does not wait for it
        # (scheduler/service/trackers.py).
        threading.Thread(target=TrackerSync().run, args=(stop,), name="trackers", daemon=True).start()
        # A scheduler that starts (or takes over) reads the backlog first, oldest first: it judges no worker
        # before the heartbeats sent while no scheduler was reading could arrive.
        self._hold_reaping()
        log.info("scheduler running (tick %.1fs, worker timeout %.0fs)",
                 self.settings.scheduler_tick_s, self.settings.worker_timeout_s)
        # On PostgreSQL, ingest has a thread of its own beside the rounds: in one loop a round's planning held the
        # stream for seconds at 256 workers, and each waits on the database, not the CPU (benchmarks/cluster_scale.py).
        # SQLite has one writer: there they take turns in one loop.
        apart = lock is not None
        if apart:
            threading.Thread(target=self._ingest_loop, args=(stop,), name="ingest", daemon=True).start()
        retry = _Retry(stop, self.settings.scheduler_tick_s, self._hold_reaping)
        try:
            while not stop.is_set():
                with retry("round"):
                    lock = self._keep_leadership(lock, stop)
                    if apart:
                        self._round(self.settings.scheduler_tick_s, stop)
                    else:
                        self.step(block_s=self.settings.scheduler_tick_s)
        finally:
            self._leading.clear()
            self.telemetry.close()
            if lock is not None:
                self._release_leadership(lock)

    def _ingest_loop(self, stop: threading.Event) -> None:
        """Ingest on its own thread (`run`, on PostgreSQL): reads and applies reports while this scheduler leads,
        and wakes the rounds when something arrived."""
        retry = _Retry(stop, self.settings.scheduler_tick_s, self._hold_reaping)
        while not stop.is_set():
            if not self._leading.wait(LEADER_POLL_S):
                continue
            with retry("ingest"):
                read = self._ingest_batch(block_s=self.settings.scheduler_tick_s)
                self._caught_up = read < BATCH
                if read:
                    self._wake.set()

    def _round(self, block_s: float, stop: threading.Event) -> None:
        """One round beside the ingest thread: rests as long as the last round took (rounds and ingest share one
        interpreter, and at 256 workers a round is seconds of CPU: back to back they left ingest a third of it), then
        waits up to block_s for something to have arrived, then acts."""
        stop.wait(self._last_tick_s)
        self._wake.wait(block_s)
        self._wake.clear()
        self._timed_tick(self._caught_up)

    @staticmethod
    def _release_leadership(lock: Connection) -> None:
        """Unlock before the connection goes back to the pool: an advisory lock belongs to the database session,
        which the pool keeps open, so a closed-but-pooled connection would go on holding it and make every other
        scheduler of the database stand by (seen when a test ran a daemon in the test process)."""
        try:
            lock.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LEADER_LOCK_ID})
            lock.commit()
        except DBAPIError:
            lock.invalidate()  # the session is gone or going: its lock with it
        finally:
            lock.close()

    def _keep_leadership(self, lock: Connection | None, stop: threading.Event) -> Connection | None:
        """The advisory lock lives as long as its connection: after a database restart it is gone, and this
        scheduler must win it again before it acts (a standby may have taken over)."""
        if lock is None:
            return None
        try:
            lock.execute(text("SELECT 1"))
            lock.commit()
            return lock
        except DBAPIError:
            log.warning("lost the scheduler lock's connection; taking the lock again")
            self._leading.clear()  # the ingest thread waits meanwhile: a standby may have taken over
            lock.invalidate()
            lock.close()
            lock = self._acquire_leadership(stop)
            self._hold_reaping()
            return lock

    def _acquire_leadership(self, stop: threading.Event) -> Connection | None:
        """On Postgres, hold an advisory lock so a second scheduler waits as a hot standby."""
        engine = get_engine()
        if engine.dialect.name != "postgresql":
            self._leading.set()
            return None
        standing_by = False
        while not stop.is_set():
            try:
                conn = engine.connect()
            except DBAPIError as exc:
                log.warning("the database is unreachable (%s); waiting", str(exc).splitlines()[0])
                stop.wait(self.settings.scheduler_tick_s)
                continue
            if conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LEADER_LOCK_ID}).scalar():
                conn.commit()
                self._leading.set()
                return conn
            conn.close()
            if not standing_by:  # said once: the standby tries again twice a second
                log.info("another scheduler holds the lock; standing by")
                standing_by = True
            stop.wait(LEADER_POLL_S)
        return None
