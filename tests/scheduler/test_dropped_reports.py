"""A report the scheduler cannot read (common/messages.py) on the real bus: the daemon logs it, counts it, acks it with
its batch (read again it would fail again) and applies the good reports around it."""

from __future__ import annotations

import pytest

from common import states
from common.bus import SCHEDULER_GROUP, SCHEDULER_STREAM, get_bus
from common.celery import worker_queue
from common.db import session_scope
from common.messages import MALFORMED, UNKNOWN_TYPE, UNKNOWN_VERSION, WorkerHeartbeat
from common.settings import get_settings
from common.tables import Worker
from common.telemetry import scheduler_metrics
from scheduler.service.daemon import SchedulerDaemon
from tests.scheduler.test_daemon import WORKER, daemon  # noqa: F401 - the fixture


def dropped(reason: str) -> float:
    return float(scheduler_metrics().messages_dropped.labels(reason=reason)._value.get())


def test_a_report_that_cannot_be_read_is_logged_counted_acked_and_the_next_is_applied(
        daemon: SchedulerDaemon, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    bus = get_bus()
    before = {reason: dropped(reason) for reason in (MALFORMED, UNKNOWN_TYPE, UNKNOWN_VERSION)}
    beat = WorkerHeartbeat(worker_id=WORKER, queue=worker_queue(get_settings(), WORKER), max_slots=8)
    bus.publish(SCHEDULER_STREAM, {"type": "trial.finished", "pack_id": "p", "worker_id": WORKER})  # no trial, status
    bus.publish(SCHEDULER_STREAM, {**beat.to_dict(), "version": 2, "worker_id": "w-from-the-future"})
    bus.publish(SCHEDULER_STREAM, {"type": "pack.resized", "pack_id": "p", "worker_id": WORKER})
    bus.publish(SCHEDULER_STREAM, beat.to_dict())
    assert daemon.step(block_s=0.2) == 4
    with session_scope() as s:
        worker = s.get(Worker, WORKER)
        assert worker is not None and worker.state == states.WORKER_ALIVE and worker.max_slots == 8
        assert s.get(Worker, "w-from-the-future") is None
    assert {reason: dropped(reason) - count for reason, count in before.items()} == {
        MALFORMED: 1, UNKNOWN_TYPE: 1, UNKNOWN_VERSION: 1}
    assert "dropping a report" in caplog.text
    # Acked with the batch: nothing waits to be read again by this consumer or any other of its group.
    assert bus.consume(SCHEDULER_STREAM, SCHEDULER_GROUP, daemon.consumer, count=10, block_s=0) == []
    assert daemon.step(block_s=0.05) == 0 and dropped(MALFORMED) == before[MALFORMED] + 1


def test_a_report_that_reads_but_makes_no_sense_is_dropped_and_counted(
        daemon: SchedulerDaemon) -> None:  # noqa: F811
    """A progress report of a negative step time is read, then refused by ingest (it would mislead the planner)."""
    from tests.scheduler.test_daemon import heartbeat, live_pack, make_task, report

    make_task(1)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    before = dropped(MALFORMED)
    report("pack.progress", pack_id=pack.id, steps=20, step_s=-1.0, tokens=200.0, slots=2.0)
    daemon.step(block_s=0.2)
    assert dropped(MALFORMED) == before + 1
    with session_scope() as s:
        assert s.get_one(type(pack), pack.id).progress is None
