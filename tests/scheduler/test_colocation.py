"""Several packs on one worker, the scheduler's side (issue 34): a worker that runs a pack and says it may run another
(`max_packs`) is planned as idle with the memory its packs left, for a pack of another model
(planner_io.room_beside_packs); a pack of the same model waits instead; a pack that shares its worker takes no
back-fill; a refused pack (`pack.refused`) gives its trials back with no attempt spent; a beat names every pack its
worker runs, and a running pack it stops naming is lost; no pack goes into the memory the worker's sampler holds.
Against the real Postgres and Redis, the worker played by publishing its reports (as tests/scheduler/test_daemon.py
does)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import select

from common import states
from common.celery import worker_queue
from common.db import session_scope
from common.settings import get_settings
from common.tables import Pack, Trial, Worker
from scheduler.service.daemon import SchedulerDaemon
from tests.scheduler.test_daemon import WORKER, fresh_daemon, make_task, report

SECOND = "smollm2-135m-instruct"  # a registered default: any model the worker does not run already
GB = 2**30


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    d = fresh_daemon(WORKER)
    d.faults = replace(d.faults, requeue_backoff_s=0)
    yield d


def beat(*, max_packs: int = 2, packs: list[dict[str, Any]] | None = None, free: int | None = None,
         sampler: int | None = None) -> None:
    report("heartbeat", queue=worker_queue(get_settings(), WORKER), device="cuda:0", memory_bytes=80 * GB, max_slots=8,
           max_packs=max_packs, packs=packs or [], free_memory_bytes=free, sampler_bytes=sampler, sent_at=time.time())


def named(*pack_ids: str, progressed_at: float | None = None) -> list[dict[str, Any]]:
    return [{"pack_id": p, "progress": 1, "progressed_at": progressed_at or time.time()} for p in pack_ids]


def live_packs() -> dict[str, Pack]:
    with session_scope() as s:
        return {p.base_model: p for p in s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE)))}


def trial_states(trial_ids: list[str]) -> list[tuple[str, int]]:
    with session_scope() as s:
        return [(t.state, t.attempts) for t in (s.get_one(Trial, i) for i in trial_ids)]


def start_first_pack(daemon: SchedulerDaemon, **beat_args: Any) -> Pack:
    beat(**beat_args)
    make_task(2)
    daemon.step(block_s=0.2)
    first = live_packs()["tiny-random-llama"]
    report("pack.started", pack_id=first.id)
    beat(packs=named(first.id), **{k: v for k, v in beat_args.items() if k != "packs"})
    daemon.step(block_s=0.2)
    return first


def test_a_pack_of_another_model_goes_beside_a_running_one_and_one_of_the_same_model_waits(
    daemon: SchedulerDaemon
) -> None:
    first = start_first_pack(daemon)
    assert first.memory_bytes is not None and 0 < first.memory_bytes < 80 * GB  # what the worker reserves for it
    _, second_trials = make_task(1, model=SECOND)
    _, same_model = make_task(1, spec={"max_steps": 4})
    daemon.step(block_s=0.2)
    packs = live_packs()
    assert set(packs) == {"tiny-random-llama", SECOND} and packs[SECOND].worker_id == WORKER
    assert packs[SECOND].memory_bytes is not None and packs[SECOND].memory_bytes > 0
    assert trial_states(second_trials) == [("running", 1)]
    # The first pack shares its worker now: no back-fill joins it, and a second pack of its model never goes there.
    assert trial_states(same_model) == [("pending", 0)]
    assert sorted(packs["tiny-random-llama"].trial_ids) == sorted(first.trial_ids)


@pytest.mark.parametrize("beat_args", [{"max_packs": 1}, {"free": GB // 1000}], ids=["one-pack", "no-memory-left"])
def test_nothing_goes_beside_a_pack_on_a_worker_of_one_pack_or_with_no_memory_left(
    daemon: SchedulerDaemon, beat_args: dict[str, Any]
) -> None:
    start_first_pack(daemon, **beat_args)
    _, second_trials = make_task(1, model=SECOND)
    daemon.step(block_s=0.2)
    assert set(live_packs()) == {"tiny-random-llama"}
    assert trial_states(second_trials) == [("pending", 0)]


def test_no_pack_goes_into_the_memory_the_workers_sampler_holds_until_it_lets_go(daemon: SchedulerDaemon) -> None:
    """A worker whose sampler process holds all but a sliver of its GPU (worker/sampler.py, `sampler_bytes` in its
    beats) gets no pack; once a beat says the sampler dropped its model, the next round places the trials there."""
    beat(max_packs=1, sampler=80 * GB - GB // 1000)
    _, trials = make_task(2)
    daemon.step(block_s=0.2)
    assert live_packs() == {} and trial_states(trials) == [("pending", 0)] * 2
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).sampler_bytes == 80 * GB - GB // 1000
    beat(max_packs=1, sampler=0)
    daemon.step(block_s=0.2)
    pack = live_packs()["tiny-random-llama"]
    assert pack.worker_id == WORKER and sorted(pack.trial_ids) == sorted(trials)


def test_a_refused_pack_gives_its_trials_back_with_no_attempt_spent(daemon: SchedulerDaemon) -> None:
    first = start_first_pack(daemon)
    _, second_trials = make_task(1, model=SECOND)
    daemon.step(block_s=0.2)
    refused = live_packs()[SECOND]
    report("pack.refused", pack_id=refused.id, reason="its planned 3.00 GB do not fit")
    beat(packs=named(first.id), free=GB // 1000)  # what the worker reserved leaves no room: it says so
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Pack, refused.id).state == states.PACK_REFUSED
    assert trial_states(second_trials) == [("pending", 0)]
    assert set(live_packs()) == {"tiny-random-llama"}  # not placed there again while it has no room


def start_both_packs(daemon: SchedulerDaemon) -> tuple[Pack, Pack]:
    """The first pack running, and a second one of another model started beside it."""
    first = start_first_pack(daemon)
    make_task(1, model=SECOND)
    daemon.step(block_s=0.2)
    second = live_packs()[SECOND]
    report("pack.started", pack_id=second.id)
    return first, second


def test_a_beat_names_every_pack_and_a_running_one_it_stops_naming_is_lost(daemon: SchedulerDaemon) -> None:
    first, second = start_both_packs(daemon)
    beat(packs=named(first.id, second.id))
    daemon.step(block_s=0.2)
    assert {p.id for p in live_packs().values()} == {first.id, second.id}
    with session_scope() as s:
        worker = s.get_one(Worker, WORKER)
        assert (worker.max_packs, worker.free_memory_bytes) == (2, None)
    time.sleep(0.01)
    beat(packs=named(second.id))  # the first pack crashed out of the process; the second trains on
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Pack, first.id).state == states.PACK_LOST
        assert s.get_one(Pack, second.id).state == states.PACK_RUNNING
        # Its trials went back to pending (and may be placed again at once: no backoff here), out of the lost pack.
        assert all(t.pack_id != first.id for t in s.scalars(select(Trial).where(Trial.id.in_(first.trial_ids))))


def test_a_stalled_second_pack_loses_the_worker(daemon: SchedulerDaemon) -> None:
    first, second = start_both_packs(daemon)
    stalled = time.time() - daemon.settings.worker_stall_s - 60
    beat(packs=named(first.id) + named(second.id, progressed_at=stalled))
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).state == states.WORKER_LOST
        assert {s.get_one(Pack, p).state for p in (first.id, second.id)} == {states.PACK_LOST}
