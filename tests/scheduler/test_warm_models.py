"""Each heartbeat's warm_models (the base models its worker holds loaded) is stored on the worker's row, malformed
entries left out, and the daemon's planner gives a pack to the worker that has its model warm. Against the real
Postgres and Redis; we play the workers by publishing their heartbeats, as tests/scheduler/test_daemon.py does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from common import states
from common.bus import SCHEDULER_STREAM, get_bus
from common.celery import worker_queue
from common.db import session_scope
from common.messages import WorkerHeartbeat
from common.settings import get_settings
from common.tables import Pack, Worker
from scheduler.service.daemon import SchedulerDaemon
from tests.scheduler.test_daemon import fresh_daemon, make_task

TINY = "tiny-random-llama"
WORKERS = ("w-warm-a", "w-warm-b")


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    yield fresh_daemon(*WORKERS)


def beat(worker_id: str, warm: Any = None) -> None:
    """A heartbeat of `worker_id` naming `warm` as its warm models (None: a beat that does not say)."""
    get_bus().publish(SCHEDULER_STREAM, WorkerHeartbeat(
        worker_id=worker_id, queue=worker_queue(get_settings(), worker_id), device="cpu", max_slots=8, pack_id=None,
        warm_models=warm).to_dict())


def entry(name: str, used: float = 1700000000.5) -> dict[str, Any]:
    return {"name": name, "revision": name, "bytes": 428_800, "last_used_at": used}


def test_a_heartbeat_stores_its_workers_warm_models_and_leaves_malformed_entries_out(daemon: SchedulerDaemon) -> None:
    beat(WORKERS[0], [entry(TINY), {"name": 5, "revision": "r", "bytes": 1, "last_used_at": 1.0}, "junk",
                      {"name": "m", "revision": "r", "bytes": True, "last_used_at": 1.0}, entry("other", 1)])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKERS[0]).warm_models == [entry(TINY), entry("other", 1.0)]
    beat(WORKERS[0], [])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKERS[0]).warm_models == []
    beat(WORKERS[0], "not a list")
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKERS[0]).warm_models is None
    beat(WORKERS[0])  # a worker from before this field does not say
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKERS[0]).warm_models is None


@pytest.mark.parametrize("warm_on", WORKERS)
def test_the_daemon_gives_the_pack_to_the_worker_that_has_its_model_warm(daemon: SchedulerDaemon,
                                                                          warm_on: str) -> None:
    # Each in turn holds the tiny model, the other another one: whichever the tie would go to without warmth,
    # one of the two cases fails if the planner ignores it.
    for worker_id in WORKERS:
        beat(worker_id, [entry(TINY if worker_id == warm_on else "smollm2-135m-instruct")])
    daemon.step(block_s=0.2)
    _, trial_ids = make_task(2)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        [pack] = s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).all()
        assert (pack.worker_id, sorted(pack.trial_ids)) == (warm_on, sorted(trial_ids))
