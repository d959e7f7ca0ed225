"""The bus through a Redis outage and a Redis restart that comes back empty (issue 14), on a private
redis-server of this test's own (never the shared one): the consumer group is created again, calls fail in
bounded time instead of hanging, a worker's reports wait in its outbox and go out in order, a scheduler round
still reaps and plans when the bus read fails."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.bus import SCHEDULER_GROUP, SCHEDULER_STREAM, RedisBus
from tests.services import _free_port, _wait_port, redis_server_argv


class PrivateRedis:
    """A redis-server that persists nothing, so `restart()` brings it back empty, like a crashed cache."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(redis_server_argv(self.port, self.workdir), stdout=subprocess.DEVNULL)
        _wait_port(self.port, "Redis")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.kill()


def test_the_consumer_group_comes_back_after_redis_restarts_empty(private_redis: PrivateRedis) -> None:
    bus = RedisBus(private_redis.url, f"lp-{uuid.uuid4().hex[:6]}")
    bus.publish(SCHEDULER_STREAM, {"i": 1})
    got = bus.consume(SCHEDULER_STREAM, SCHEDULER_GROUP, "c", count=10, block_s=0.1)
    assert [m for _, m in got] == [{"i": 1}] and bus.resets == 0
    private_redis.restart()  # streams, groups and claims are gone
    bus.publish(SCHEDULER_STREAM, {"i": 2})  # the connection is re-made by the client's retry
    got = bus.consume(SCHEDULER_STREAM, SCHEDULER_GROUP, "c", count=10, block_s=0.1)
    assert [m for _, m in got] == [{"i": 2}] and bus.resets == 1
    bus.ack(SCHEDULER_STREAM, SCHEDULER_GROUP, [i for i, _ in got])
    assert bus.consume(SCHEDULER_STREAM, SCHEDULER_GROUP, "c", count=10, block_s=0.1) == []


def test_a_call_while_redis_is_down_fails_in_bounded_time(private_redis: PrivateRedis) -> None:
    bus = RedisBus(private_redis.url, f"lp-{uuid.uuid4().hex[:6]}")
    bus.publish("s", {"i": 1})
    private_redis.kill()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        bus.publish("s", {"i": 2})
    # A generous bound (the retry budget is under a second): the point is that it does not hang.
    assert time.monotonic() - started < 30


def test_a_reporter_keeps_reports_in_order_through_an_outage(private_redis: PrivateRedis) -> None:
    from common.messages import PackStarted, TrialCheckpoint
    from worker.bus_client import Reporter, ReportsLost
    from worker.heartbeat import Incarnation

    ns = f"lp-{uuid.uuid4().hex[:6]}"
    bus = RedisBus(private_redis.url, ns)
    reporter = Reporter(bus, "pack-1", "w", Incarnation(), max_outbox=50)
    reporter.send(PackStarted)
    private_redis.kill()
    for step in range(1, 6):  # training goes on: nothing raises while the outbox has room
        reporter.point("t1", step, "train", 1.0)
        reporter.flush()
    reporter.send(TrialCheckpoint, trial_id="t1", step=5, checkpoint_key="ck")
    private_redis.start()  # back, empty
    assert reporter.close(timeout_s=30)
    got = [m for _, m in RedisBus(private_redis.url, ns).read_after(SCHEDULER_STREAM, "0", count=100, block_s=0)]
    # What was sent before the restart is gone with it; the checkpoint carries the trial's points again.
    assert [m["type"] for m in got][-1] == "trial.checkpoint"
    assert [p[1] for p in got[-1]["points"]] == [1, 2, 3, 4, 5]
    train_steps = [p[1] for m in got if m["type"] == "points" for p in m["points"]]
    assert train_steps == sorted(train_steps) and set(train_steps) <= {1, 2, 3, 4, 5}
    assert all(m["incarnation"] == reporter.incarnation.id and "sent_at" in m for m in got)

    private_redis.kill()
    with pytest.raises(ReportsLost):  # a bus away for too long: the pack must stop, not grow without bound
        for step in range(100):
            reporter.point("t1", step, "train", 1.0)
            reporter.flush()
    assert not reporter.close(timeout_s=0.5)


def test_a_worker_inbox_reads_nothing_while_redis_is_down_and_carries_on(private_redis: PrivateRedis) -> None:
    from worker.bus_client import CommandInbox

    bus = RedisBus(private_redis.url, f"lp-{uuid.uuid4().hex[:6]}")
    inbox = CommandInbox(bus, "w", poll_s=0)
    private_redis.kill()
    assert inbox.stopped_trials("p") == {} and not inbox.aborted("p")
    private_redis.start()
    bus.publish("commands:w", {"type": "abort_pack", "pack_id": "p"})
    assert not inbox.aborted("p")  # after a failed read it waits before reading again (training goes on)
    inbox._last_poll = 0.0
    assert inbox.aborted("p")


def test_a_scheduler_round_plans_while_the_bus_is_down_and_reaps_once_workers_could_be_heard(
    private_redis: PrivateRedis, clean_db: None,
) -> None:
    from sqlalchemy import select

    from common import states
    from common.celery import get_celery, worker_queue
    from common.db import session_scope
    from common.settings import get_settings
    from common.tables import Pack, Worker, utcnow
    from scheduler.service.daemon import SchedulerDaemon
    from tests.scheduler.test_daemon import WORKER, make_task

    make_task(2)
    with session_scope() as s:  # a live worker, known from its heartbeats before the outage, and a silent one
        s.add(Worker(id=WORKER, queue=worker_queue(get_settings(), WORKER), device="cpu", max_slots=8,
                     state=states.WORKER_ALIVE, last_heartbeat=utcnow(), registered_at=utcnow()))
        s.add(Worker(id="silent", queue="q", device="cpu", max_slots=8, state=states.WORKER_ALIVE,
                     last_heartbeat=utcnow().replace(year=2000), registered_at=utcnow()))
    bus = RedisBus(private_redis.url, f"lp-{uuid.uuid4().hex[:6]}")
    settings = get_settings().model_copy(update={"worker_timeout_s": 3.0})
    daemon = SchedulerDaemon(settings, bus, get_celery(), consumer="test")
    private_redis.kill()
    daemon.step(block_s=0.1)  # the read fails; the round goes on from the database
    with session_scope() as s:
        (pack,) = s.scalars(select(Pack)).all()
        assert pack.worker_id == WORKER and pack.state == states.PACK_DISPATCHED  # Celery's broker is up
        # No heartbeat can get through while the bus is away: silence is not taken for death.
        assert s.get_one(Worker, "silent").state == states.WORKER_ALIVE
    private_redis.start()
    time.sleep(3.2)  # the bus has been back for a full worker timeout: silence counts again
    daemon.step(block_s=0.1)
    with session_scope() as s:
        assert s.get_one(Worker, "silent").state == states.WORKER_LOST
