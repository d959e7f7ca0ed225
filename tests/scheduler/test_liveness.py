"""Liveness that cannot be fooled (issue 14): incarnations, the time a heartbeat carries, the pack a heartbeat
names, and reports from a process that does not run their pack; and a pack that beats but makes no progress (issue
32: a hung training process; the heartbeat's own process: tests/worker/test_heartbeat.py). The daemon runs against
the real Postgres and Redis; we play the worker by publishing its messages, as tests/scheduler/test_daemon.py does."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import func, select

from common import states
from common.bus import SCHEDULER_STREAM, commands_stream, get_bus
from common.celery import worker_queue
from common.db import session_scope
from common.messages import REPORT_TYPES, AbortPack
from common.settings import get_settings
from common.tables import Event, MetricPoint, Pack, Trial, Worker
from scheduler.service.daemon import SchedulerDaemon
from tests.scheduler.test_daemon import WORKER, fresh_daemon, live_pack, make_task


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    d = fresh_daemon(WORKER)
    d.faults = replace(d.faults, requeue_backoff_s=0)  # requeued trials may be placed again at once
    yield d


class FakeProcess:
    """One worker process's identity on the bus: what worker/bus_client.py puts in every message."""

    def __init__(self, started_at: float | None = None) -> None:
        self.incarnation = uuid.uuid4().hex
        self.started_at = time.time() if started_at is None else started_at

    def beat(self, pack_id: str | None, sent_at: float | None = None, **progress: Any) -> None:
        self.publish("heartbeat", queue=worker_queue(get_settings(), WORKER), device="cpu", max_slots=8,
                     pack_id=pack_id, started_at=self.started_at, sent_at=time.time() if sent_at is None else sent_at,
                     **progress)

    def report(self, kind: str, **fields: Any) -> None:
        self.publish(kind, sent_at=time.time(), **fields)

    def publish(self, kind: str, **fields: Any) -> None:
        message = REPORT_TYPES[kind](**{"worker_id": WORKER, "incarnation": self.incarnation, **fields})
        get_bus().publish(SCHEDULER_STREAM, message.to_dict())


def start_pack(daemon: SchedulerDaemon, proc: FakeProcess, n_trials: int = 2) -> tuple[Pack, list[str]]:
    _, trial_ids = make_task(n_trials, steps=20)
    proc.beat(None)
    daemon.step(block_s=0.2)
    pack = live_pack()
    proc.beat(pack.id)
    proc.report("pack.started", pack_id=pack.id)
    for t in trial_ids:
        proc.report("points", pack_id=pack.id, points=[[t, s, "train", 3.0 - s / 10] for s in range(1, 5)])
        proc.report("trial.checkpoint", pack_id=pack.id, trial_id=t, step=4, checkpoint_key=f"ck/{t}/4")
    proc.beat(pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get(Pack, pack.id).state == states.PACK_RUNNING  # type: ignore[union-attr]
    return pack, trial_ids


def pack_state(pack_id: str) -> str:
    with session_scope() as s:
        return s.get_one(Pack, pack_id).state


def test_a_new_process_under_the_same_id_ends_the_old_ones_pack_at_once(daemon: SchedulerDaemon) -> None:
    old = FakeProcess()
    pack, trial_ids = start_pack(daemon, old)
    new = FakeProcess()
    new.beat(None)  # well within the heartbeat timeout: no waiting for it
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Pack, pack.id).state == states.PACK_LOST
        worker = s.get_one(Worker, WORKER)
        assert worker.incarnation == new.incarnation and worker.state == states.WORKER_ALIVE
        requeued = s.scalars(select(Event).where(Event.type == "trial.requeued")).all()
        assert sorted(e.trial_id for e in requeued) == sorted(trial_ids)  # type: ignore[type-var]
        assert {e.data["resume_step"] for e in requeued} == {4}
        assert all("restarted" in e.message for e in requeued)
        # ...and the trials were planned again, on the new process, in a new pack.
        trials = s.scalars(select(Trial)).all()
        assert {t.state for t in trials} == {states.TRIAL_RUNNING} and {t.pack_id for t in trials} != {pack.id}
    # The dead process's late reports change nothing.
    old.report("trial.finished", pack_id=pack.id, trial_id=trial_ids[0], status="completed", steps_done=20,
               best_val_loss=0.1, best_step=20, final_train_loss=0.1, adapter_key="x", points=[])
    old.beat(pack.id)  # an old beat read late: from the process the new one replaced
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).incarnation == new.incarnation
        assert s.get_one(Trial, trial_ids[0]).state == states.TRIAL_RUNNING


def test_a_heartbeat_naming_no_pack_ends_the_running_pack(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    pack, _ = start_pack(daemon, proc)
    proc.beat(None)  # the same process, no longer running it (its reports were lost with the bus)
    daemon.step(block_s=0.2)
    assert pack_state(pack.id) == states.PACK_LOST


def test_a_heartbeat_sent_before_the_pack_started_does_not_end_it(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    make_task(1)
    proc.beat(None)
    daemon.step(block_s=0.2)
    pack = live_pack()
    before = time.time()
    proc.report("pack.started", pack_id=pack.id)
    proc.beat(None, sent_at=before - 0.5)  # read after `pack.started`, sent before it (a replayed batch)
    daemon.step(block_s=0.2)
    assert pack_state(pack.id) == states.PACK_RUNNING


def test_a_stale_heartbeat_does_not_keep_a_dead_worker_alive(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    pack, _ = start_pack(daemon, proc)
    timeout = get_settings().worker_timeout_s
    with session_scope() as s:  # the worker went silent long ago...
        s.get_one(Worker, WORKER).last_heartbeat = s.get_one(Worker, WORKER).last_heartbeat.replace(year=2000)
    proc.beat(pack.id, sent_at=time.time() - timeout - 5)  # ...and a beat it sent before it died is read now
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).state == states.WORKER_LOST
    assert pack_state(pack.id) == states.PACK_LOST


def test_a_heartbeat_naming_a_pack_that_is_over_gets_an_abort_command(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    bus = get_bus()
    tail = bus.tail_id(commands_stream(WORKER))
    pack, _ = start_pack(daemon, proc)
    with session_scope() as s:  # declared lost while the worker could not report
        s.get_one(Pack, pack.id).state = states.PACK_LOST
    proc.beat(pack.id)
    daemon.step(block_s=0.2)
    proc.beat(pack.id)
    daemon.step(block_s=0.2)
    commands = [m for _, m in bus.read_after(commands_stream(WORKER), tail, count=10, block_s=0.1)]
    assert [c for c in commands if c["type"] == "abort_pack"] == [AbortPack(pack_id=pack.id).to_dict()]


def test_reports_from_another_process_than_the_packs_are_dropped(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    pack, trial_ids = start_pack(daemon, proc)
    FakeProcess().report("trial.finished", pack_id=pack.id, trial_id=trial_ids[0], status="completed",
                         steps_done=20, best_val_loss=0.1, best_step=20, final_train_loss=0.1, adapter_key="x",
                         points=[])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Trial, trial_ids[0]).state == states.TRIAL_RUNNING


def test_points_lost_in_flight_are_filled_in_by_the_checkpoint_and_the_end_reports(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    pack, trial_ids = start_pack(daemon, proc, n_trials=1)
    (t,) = trial_ids
    # Steps 5-8 were published and lost (Redis restarted empty); the checkpoint at 8 carries them again.
    points = [[t, s, "train", 2.0] for s in range(5, 9)]
    proc.report("trial.checkpoint", pack_id=pack.id, trial_id=t, step=8, checkpoint_key=f"ck/{t}/8", points=points)
    proc.report("trial.finished", pack_id=pack.id, trial_id=t, status="completed", steps_done=10,
                best_val_loss=1.0, best_step=10, final_train_loss=1.0, adapter_key="a",
                points=[[t, 9, "train", 1.5], [t, 10, "train", 1.4], [t, 10, "val", 1.0]])
    proc.beat(pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        steps = sorted(s.scalars(select(MetricPoint.step).where(MetricPoint.trial_id == t,
                                                                MetricPoint.split == "train")))
        assert steps == list(range(1, 11))
        assert s.scalar(select(func.count()).select_from(MetricPoint).where(MetricPoint.split == "val")) == 1
        assert s.get_one(Trial, t).state == states.TRIAL_COMPLETED


def test_a_trial_whose_checkpoint_is_gone_starts_again_from_step_zero(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    pack, trial_ids = start_pack(daemon, proc, n_trials=1)
    (t,) = trial_ids
    proc.beat(None)  # the process left the pack: requeued from its checkpoint at step 4
    daemon.step(block_s=0.2)
    pack2 = live_pack()
    assert pack2.id != pack.id
    # The worker finds the checkpoint gone (it replaced it while the database could not record the newer one).
    proc.beat(pack2.id)
    proc.report("pack.started", pack_id=pack2.id)
    proc.report("trial.checkpoint_lost", pack_id=pack2.id, trial_id=t, checkpoint_key=f"ck/{t}/4")
    proc.report("points", pack_id=pack2.id, points=[[t, 1, "train", 3.0], [t, 2, "train", 2.9]])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        trial = s.get_one(Trial, t)
        assert (trial.checkpoint_key, trial.checkpoint_step, trial.steps_done) == (None, None, 2)
        assert sorted(s.scalars(select(MetricPoint.step).where(MetricPoint.trial_id == t))) == [1, 2]
        assert s.scalars(select(Event).where(Event.type == "trial.restarted")).one().trial_id == t


def commands_since(tail: str) -> list[dict[str, Any]]:
    return [m for _, m in get_bus().read_after(commands_stream(WORKER), tail, count=100, block_s=0.1)]


def test_a_pack_that_beats_but_makes_no_progress_is_lost_and_its_worker_gets_nothing_while_it_hangs(
        daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    tail = get_bus().tail_id(commands_stream(WORKER))
    pack, trial_ids = start_pack(daemon, proc)
    stall_s = get_settings().worker_stall_s
    hung_since = time.time() - stall_s - 60  # its count stopped changing more than the stall limit ago
    proc.beat(pack.id, progress=4, progressed_at=hung_since)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Pack, pack.id).state == states.PACK_LOST
        assert s.get_one(Worker, WORKER).state == states.WORKER_LOST
        requeued = s.scalars(select(Event).where(Event.type == "trial.requeued")).all()
        assert sorted(e.trial_id for e in requeued) == sorted(trial_ids)  # type: ignore[type-var]
        assert all("made no progress" in e.message and e.data["resume_step"] == 4 for e in requeued)
    assert AbortPack(pack_id=pack.id).to_dict() in commands_since(tail)  # should it wake, it stops
    # Its beats go on saying so: the worker stays lost, and its trials are not placed on it again.
    proc.beat(pack.id, progress=4, progressed_at=hung_since)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).state == states.WORKER_LOST
        assert {t.state for t in s.scalars(select(Trial))} == {states.TRIAL_PENDING}
    # It woke and left the pack: well again, and its trials are placed on it.
    proc.beat(None)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).state == states.WORKER_ALIVE
        assert {t.state for t in s.scalars(select(Trial))} == {states.TRIAL_RUNNING}


def test_a_slow_pack_that_progresses_is_not_lost(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    pack, _ = start_pack(daemon, proc)
    stall_s = get_settings().worker_stall_s
    # A long phase (a model's load, a validation) still inside the limit, and a beat of a worker from before progress
    # was reported: neither is a stall.
    proc.beat(pack.id, progress=0, progressed_at=time.time() - stall_s + 60)
    proc.beat(pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Pack, pack.id).state == states.PACK_RUNNING
        assert s.get_one(Worker, WORKER).state == states.WORKER_ALIVE


def test_a_draining_worker_gets_nothing_and_the_trials_it_hands_back_are_pending_at_once(
        daemon: SchedulerDaemon) -> None:
    """SIGTERM drains a worker (worker/drain.py): its beat says so, and its trials come back paused with `drained`,
    each from the checkpoint it took as it paused: pending at once, no attempt spent, nothing requeued as from a lost
    worker, and nothing planned on the draining worker. Silent, it is lost; a new process under its id gets them."""
    proc = FakeProcess()
    pack, trial_ids = start_pack(daemon, proc)
    proc.beat(pack.id, draining=True)
    for t in trial_ids:
        proc.report("points", pack_id=pack.id, points=[[t, s, "train", 2.0] for s in (5, 6)])
        proc.report("trial.checkpoint", pack_id=pack.id, trial_id=t, step=6, checkpoint_key=f"ck/{t}/6")
        proc.report("trial.finished", pack_id=pack.id, trial_id=t, status="paused", steps_done=6, drained=True)
    proc.report("pack.finished", pack_id=pack.id)
    proc.beat(None, draining=True)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).state == states.WORKER_DRAINING
        assert s.get_one(Pack, pack.id).state == states.PACK_FINISHED
        trials = s.scalars(select(Trial)).all()
        assert [(t.state, t.pack_id, t.checkpoint_step, t.attempts) for t in trials] == [
            (states.TRIAL_PENDING, None, 6, 0)] * len(trial_ids)
        paused = s.scalars(select(Event).where(Event.type == "trial.paused")).all()
        assert sorted(e.trial_id for e in paused) == sorted(trial_ids)  # type: ignore[type-var]
        assert all(e.data["drained"] and "shutting down" in e.message for e in paused)
        assert not s.scalars(select(Event).where(Event.type == "trial.requeued")).all()
        assert s.scalar(select(func.count()).select_from(Pack)) == 1  # nothing planned on the draining worker
    with session_scope() as s:  # its beats stopped long ago: it exited
        s.get_one(Worker, WORKER).last_heartbeat = s.get_one(Worker, WORKER).last_heartbeat.replace(year=2000)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).state == states.WORKER_LOST
    FakeProcess().beat(None)  # the same id restarted: alive, and the trials are placed on it
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).state == states.WORKER_ALIVE
        assert {t.state for t in s.scalars(select(Trial))} == {states.TRIAL_RUNNING}
