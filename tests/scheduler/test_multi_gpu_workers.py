"""Workers that own several GPUs of one host (`loraplane worker --gpus 0,1`): the heartbeat's `gpus`, one planning
unit holding all of its GPUs' memory, and the memory prior of a model from its registered size, so that a model
larger than one GPU waits for a worker whose GPUs hold it. The daemon runs against the real Postgres and Redis; we
play the workers by publishing their messages, as tests/scheduler/test_daemon.py does."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import select

from common import states
from common.bus import SCHEDULER_STREAM, get_bus
from common.celery import worker_queue
from common.db import session_scope
from common.messages import WorkerHeartbeat
from common.registry import DEFAULT_MODELS
from common.settings import get_settings
from common.tables import BaseModelEntry, Pack, Trial, Worker, utcnow
from scheduler.planning.cost import ModelCost, prior_cost
from scheduler.planning.estimate import TrialLoad, UsableWorker, estimate
from scheduler.planning.placement import Placement, place
from scheduler.planning.types import DEFAULT_GPU_BYTES, LiveWorker, PendingTrial, Snapshot, planning_input
from scheduler.service.daemon import SchedulerDaemon
from scheduler.service.ingest import ingest
from tests.conftest import REDIS_URL
from tests.scheduler.test_daemon import WORKER, fresh_daemon, make_task
from tests.scheduler.test_placement import H100_BYTES

H200_BYTES = 141 * 10**9  # an H200's 141 GB
H200X2 = "w-h200x2"  # a worker over two H200s of one host
BIG = "llama-3.1-70b"
BIG_PARAMETERS = 70_000_000_000  # 140 GB of bf16 weights: more than one H100 or one H200 holds
SMOL = "smollm2-135m-instruct"
SMOL_PARAMETERS = next(m.parameters for m in DEFAULT_MODELS if m.name == SMOL)
# What the daemon's cluster_state.load_costs gives two registered models that no pack has profiled yet.
COSTS: dict[str, ModelCost] = {BIG: prior_cost(BIG_PARAMETERS), SMOL: prior_cost(SMOL_PARAMETERS)}
TOKENS = 4 * 512  # batch 4 × the API's default max_seq_len: 4 GiB on the memory prior, more than an H200 has left


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    d = fresh_daemon(WORKER, H200X2)
    yield d
    redis.Redis.from_url(REDIS_URL).delete(worker_queue(get_settings(), H200X2))


def beat(worker_id: str = WORKER, **fields: Any) -> None:
    """A heartbeat of `worker_id` with these fields besides its identity (no `gpus`: a beat that does not say)."""
    get_bus().publish(SCHEDULER_STREAM, {
        "type": "heartbeat", "worker_id": worker_id, "queue": worker_queue(get_settings(), worker_id),
        "device": "cuda:0", "max_slots": 8, **fields})


def stored_gpus(worker_id: str = WORKER) -> int:
    with session_scope() as s:
        worker = s.get_one(Worker, worker_id)
        assert worker.state == states.WORKER_ALIVE
        return worker.gpus


def test_a_heartbeat_stores_its_workers_gpus(daemon: SchedulerDaemon) -> None:
    beat(gpus=2, memory_bytes=H200_BYTES)
    daemon.step(block_s=0.2)
    assert stored_gpus() == 2
    beat(memory_bytes=H200_BYTES)  # a worker from before the field: one GPU
    daemon.step(block_s=0.2)
    assert stored_gpus() == 1
    beat(gpus=4.0)  # how some JSON encoder may write 4
    daemon.step(block_s=0.2)
    assert stored_gpus() == 4


@pytest.mark.parametrize("bad", [0, -1, "2", 2.5, True, None, 10**30, [2]])
def test_a_bad_gpus_is_taken_as_one_and_stops_nothing(daemon: SchedulerDaemon, bad: object) -> None:
    beat(gpus=2)
    daemon.step(block_s=0.2)
    assert stored_gpus() == 2
    beat(gpus=bad)
    beat(H200X2, gpus=2)  # in the same batch, after the bad one: still applied
    daemon.step(block_s=0.2)
    assert (stored_gpus(), stored_gpus(H200X2)) == (1, 2)


def test_a_change_of_gpus_is_worth_a_replan(clean_db: None) -> None:
    start = utcnow()

    def beat_at(seconds: float, **fields: Any) -> bool:
        message = WorkerHeartbeat(worker_id="w-gpus", queue="q.w-gpus", **fields)
        with session_scope() as s:
            return ingest(s, [message], now=start + timedelta(seconds=seconds))

    assert beat_at(0)  # a new worker
    assert not beat_at(1)  # nothing new
    assert beat_at(2, gpus=2)
    assert not beat_at(3, gpus=2)
    assert beat_at(4)  # one GPU again (an older worker under its id)


def trial(i: int, model: str) -> PendingTrial:
    return PendingTrial(trial_id=f"{model}-{i}", task_id=f"task-{model}", tenant_id="ten", base_model=model,
                        max_trials_per_pack=8, remaining_steps=100, tokens_per_step=TOKENS)


def test_planning_input_gives_a_worker_all_of_its_gpus_memory() -> None:
    snapshot = Snapshot(
        pending=(trial(0, SMOL),),
        idle_workers=(LiveWorker("h100", 8, H100_BYTES), LiveWorker(H200X2, 8, H200_BYTES, gpus=2),
                      LiveWorker("unsaid", 8, None, gpus=2)),
        busy_workers=(LiveWorker("busy", 8, H200_BYTES, busy_for_s=30.0, gpus=4),),
    )
    gpus = {g.worker_id: g.memory_bytes for g in planning_input(snapshot, {}, unit_s=1.0).workers}
    assert gpus == {"h100": H100_BYTES, H200X2: 2 * H200_BYTES, "unsaid": 2 * DEFAULT_GPU_BYTES,
                    "busy": 4 * H200_BYTES}


def placed(placement: Placement) -> dict[str, tuple[str, ...]]:
    """Worker -> the trials of the pack it starts now."""
    return {p.worker_id: tuple(sorted(p.trial_ids)) for p in placement.plan.packs}


def test_a_model_larger_than_a_gpu_is_placed_only_on_a_worker_whose_gpus_hold_it() -> None:
    big, small = (trial(0, BIG), trial(1, BIG)), (trial(0, SMOL),)
    h100, h200 = LiveWorker("h100", 8, H100_BYTES), LiveWorker("h200", 8, H200_BYTES)
    h200x2 = LiveWorker(H200X2, 8, H200_BYTES, gpus=2)
    for one_gpu in (h100, h200):  # its 140 GB of weights alone fill either
        placement = place(Snapshot(pending=(*big, *small), idle_workers=(one_gpu,)), COSTS)
        assert placed(placement) == {one_gpu.worker_id: (small[0].trial_id,)}
        assert placement.result is not None
        assert sorted(placement.result.unschedulable) == sorted(t.trial_id for t in big)
    placement = place(Snapshot(pending=big, idle_workers=(h200x2,)), COSTS)
    assert placed(placement) == {H200X2: tuple(sorted(t.trial_id for t in big))}
    assert placed(place(Snapshot(pending=small, idle_workers=(h200x2,)), COSTS)) == {H200X2: (small[0].trial_id,)}
    # Both kinds of worker idle: the big model's trials go where they fit, the small model's to the other.
    placement = place(Snapshot(pending=(*big, *small), idle_workers=(h100, h200x2)), COSTS)
    assert placed(placement) == {H200X2: tuple(sorted(t.trial_id for t in big)), "h100": (small[0].trial_id,)}


def test_the_estimate_plans_on_a_workers_gpus_too() -> None:
    trials = [TrialLoad(steps=100, tokens_per_step=TOKENS)] * 2

    def wall(gpus: list[UsableWorker]) -> float | None:
        return estimate(trials, COSTS[BIG], gpus, max_trials_per_pack=8, on_priors=True).wall_seconds

    assert wall([UsableWorker(H100_BYTES)]) is None and wall([UsableWorker(H200_BYTES)]) is None
    assert wall([UsableWorker(H200_BYTES, gpus=2)]) is not None
    # A pack holds every GPU of its worker: GPU seconds are its time on the worker times the worker's GPUs.
    small = estimate(trials, COSTS[SMOL], [UsableWorker(H200_BYTES)], max_trials_per_pack=8, on_priors=True)
    doubled = estimate(trials, COSTS[SMOL], [UsableWorker(H200_BYTES, gpus=2)], max_trials_per_pack=8, on_priors=True)
    assert doubled.wall_seconds == small.wall_seconds
    assert doubled.gpu_seconds == pytest.approx(2 * small.gpu_seconds)


def packs() -> dict[str, tuple[str, list[str]]]:
    with session_scope() as s:
        return {p.worker_id: (p.base_model, sorted(p.trial_ids)) for p in s.scalars(select(Pack))}


def pack_gpus() -> dict[str, int]:
    with session_scope() as s:
        return {p.worker_id: p.gpus for p in s.scalars(select(Pack))}


def test_the_daemon_waits_with_a_70b_task_for_a_worker_whose_gpus_hold_it(daemon: SchedulerDaemon) -> None:
    """Through the daemon's own round: the registry's parameter count reaches the memory prior (load_costs), the
    heartbeat's `gpus` the worker's memory (ingest, build_snapshot, planning_input)."""
    with session_scope() as s:
        s.add(BaseModelEntry(name=BIG, kind="hf", path="/models/llama-3.1-70b", parameters=BIG_PARAMETERS))
    # The older task first: on a prior that ignored its size it would take the first free worker.
    _, big_trials = make_task(2, model=BIG, seq_len=512, batch=4)
    _, small_trials = make_task(2, model=SMOL, seq_len=512, batch=4)
    beat(memory_bytes=H100_BYTES)  # one 80 GB GPU, from a worker that does not say `gpus`
    daemon.step(block_s=0.2)
    assert packs() == {WORKER: (SMOL, sorted(small_trials))}
    with session_scope() as s:
        assert {t.state for t in s.scalars(select(Trial).where(Trial.id.in_(big_trials)))} == {states.TRIAL_PENDING}
    beat(H200X2, memory_bytes=H200_BYTES, gpus=2)
    daemon.step(block_s=0.2)
    assert packs() == {WORKER: (SMOL, sorted(small_trials)), H200X2: (BIG, sorted(big_trials))}
    assert pack_gpus() == {WORKER: 1, H200X2: 2}  # what its GPU time is counted over (common/usage.py)
