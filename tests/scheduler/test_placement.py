"""The daemon's CP-SAT placement on snapshots: what starts now, on which idle worker, never breaking a cap."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from common.settings import DEFAULT_MAX_TRIALS_PER_PACK
from scheduler.planning.cost import PRIOR_COST, ModelCost, StepTimeModel, prior_cost
from scheduler.planning.placement import Solver, place, rejoin
from scheduler.planning.types import LivePack, LiveWorker, PendingTrial, RunningMember, Snapshot


def trial(i: int, model: str = "m", cap: int = 8, task: str = "t1", steps: int = 100) -> PendingTrial:
    return PendingTrial(trial_id=f"tr{i}", task_id=task, tenant_id="ten", base_model=model,
                        max_trials_per_pack=cap, remaining_steps=steps, tokens_per_step=512)  # fmt: skip


def test_nothing_to_decide_gives_no_packs_and_no_solve() -> None:
    assert place(Snapshot(pending=(), idle_workers=(LiveWorker("w0", 8),)), {}).result is None
    assert place(Snapshot(pending=(trial(0),), idle_workers=()), {}).plan.packs == ()


def test_two_idle_workers_share_the_work_and_every_trial_starts_once() -> None:
    snap = Snapshot(pending=tuple(trial(i) for i in range(4)), idle_workers=(LiveWorker("w0", 8), LiveWorker("w1", 8)))
    placement = place(snap, {})
    packs = placement.plan.packs
    placed = [t for p in packs for t in p.trial_ids]
    assert sorted(placed) == [f"tr{i}" for i in range(4)]
    # Splitting halves each pack's pooled tokens per step: both workers are used.
    assert sorted(p.worker_id for p in packs) == ["w0", "w1"]
    assert placement.result is not None and placement.result.status in ("optimal", "feasible")


def test_caps_models_and_busy_workers_are_respected_on_random_snapshots() -> None:
    rng = random.Random(0)
    for _ in range(25):
        n_idle, n_busy = rng.randint(1, 3), rng.randint(0, 2)
        idle = tuple(LiveWorker(f"w{i}", rng.choice([2, 4, 8])) for i in range(n_idle))
        busy = tuple(LiveWorker(f"b{i}", 8, None, busy_for_s=rng.uniform(1, 500)) for i in range(n_busy))
        pending = tuple(
            trial(i, model=rng.choice(["a", "b"]), cap=rng.choice([1, 2, 8]), task=f"t{i % 3}",
                  steps=rng.randint(1, 300))
            for i in range(rng.randint(1, 10))
        )  # fmt: skip
        by_id = {t.trial_id: t for t in pending}
        packs = place(Snapshot(pending, idle, busy), {}, time_limit_s=0.5).plan.packs
        workers = [p.worker_id for p in packs]
        assert len(workers) == len(set(workers)), "two packs on one worker"
        assert set(workers) <= {w.worker_id for w in idle}, "a pack on a busy worker"
        placed = [t for p in packs for t in p.trial_ids]
        assert len(placed) == len(set(placed)), "a trial placed twice"
        slots = min(w.max_slots for w in (*idle, *busy))
        for p in packs:
            members = [by_id[t] for t in p.trial_ids]
            assert {m.base_model for m in members} == {p.base_model}
            assert len(members) <= min(slots, *(m.max_trials_per_pack for m in members))
        if pending:
            assert packs, "idle workers and pending trials, but nothing started"


def test_a_models_trials_go_only_to_workers_that_can_load_it_on_random_snapshots() -> None:
    rng = random.Random(16)
    sets = (None, frozenset({"a"}), frozenset({"b"}), frozenset())
    for _ in range(25):
        idle = tuple(LiveWorker(f"w{i}", 8, models=rng.choice(sets)) for i in range(rng.randint(1, 3)))
        busy = tuple(LiveWorker(f"b{i}", 8, None, busy_for_s=rng.uniform(1, 500), models=rng.choice(sets))
                     for i in range(rng.randint(0, 2)))
        pending = tuple(trial(i, model=rng.choice(["a", "b"]), steps=rng.randint(1, 300)) for i in range(6))
        by_id = {t.trial_id: t for t in pending}
        placement = place(Snapshot(pending, idle, busy), {}, time_limit_s=0.5)
        workers = {w.worker_id: w for w in idle}
        for p in placement.plan.packs:
            assert workers[p.worker_id].can_load(p.base_model), (p, workers[p.worker_id])
            assert {by_id[t].base_model for t in p.trial_ids} == {p.base_model}
        unloadable = {t.trial_id for t in pending if not any(w.can_load(t.base_model) for w in (*idle, *busy))}
        assert placement.result is not None and unloadable <= set(placement.result.unschedulable)
        assert not unloadable & {t for p in placement.plan.packs for t in p.trial_ids}


def test_an_idle_worker_that_cannot_load_the_model_is_left_idle() -> None:
    pending = (trial(0, model="big"), trial(1, model="big"))
    snap = Snapshot(pending, idle_workers=(LiveWorker("w-small", 8, models=frozenset({"m"})),))
    assert place(snap, {}).plan.packs == ()
    snap = replace(snap, idle_workers=(*snap.idle_workers, LiveWorker("w-any", 8)))
    (pack,) = place(snap, {}).plan.packs
    assert (pack.worker_id, pack.base_model, sorted(pack.trial_ids)) == ("w-any", "big", ["tr0", "tr1"])


def live_pack(pack_id: str, tasks: frozenset[str], free: int, max_rank: int = 16) -> LivePack:
    members = tuple(RunningMember(f"{pack_id}-m{i}", "ten", 1, 400, 512) for i in range(4))
    return LivePack(pack_id=pack_id, worker_id=f"w-{pack_id}", base_model="m", free_slots=free, members=4,
                    max_rank=max_rank, target_modules=("all-linear",), tokens_per_step=2048, busy_for_s=400.0,
                    member_list=members, task_ids=tasks)  # fmt: skip


def resumed(i: int, task: str, rank: int = 8) -> PendingTrial:
    return replace(trial(i, task=task, steps=300), resumed=True, lora_rank=rank)


def test_resumed_trials_rejoin_a_running_pack_of_their_own_task_before_the_solver_runs() -> None:
    """Kept at the warm-up ranking: back into the pack their task runs in, even with a worker idle."""
    snap = Snapshot(pending=(resumed(0, "t1"), trial(1, task="t1"), resumed(2, "t2"), resumed(3, "t1")),
                    idle_workers=(LiveWorker("w0", 8),), busy_workers=(LiveWorker("w-p1", 8, None, busy_for_s=400.0),),
                    live_packs=(live_pack("p1", frozenset({"t1"}), free=8),))
    placement = place(snap, {})
    (rejoin,) = [b for b in placement.plan.backfills if b.trial_ids[0] == "tr0"]
    assert (rejoin.pack_id, rejoin.worker_id, rejoin.trial_ids) == ("p1", "w-p1", ("tr0", "tr3"))
    placed = [t for p in placement.plan.packs for t in p.trial_ids]
    placed += [t for b in placement.plan.backfills for t in b.trial_ids]
    # The fresh trial and the other task's resumed one are the solver's to place now or later (once at most).
    assert len(placed) == len(set(placed)) and {"tr0", "tr3"} <= set(placed)


def test_rejoin_respects_free_slots_and_what_the_pack_can_take() -> None:
    pack = live_pack("p1", frozenset({"t1"}), free=1, max_rank=8)
    snap = Snapshot(pending=(resumed(0, "t1", rank=16), resumed(1, "t1"), resumed(2, "t1")), idle_workers=(),
                    live_packs=(pack,))
    backfills, left = rejoin(snap)
    assert [(b.pack_id, b.trial_ids) for b in backfills] == [("p1", ("tr1",))]  # tr0's rank 16 > padding 8
    assert [t.trial_id for t in left.pending] == ["tr0", "tr2"]
    assert left.live_packs[0].free_slots == 0
    assert rejoin(replace(snap, live_packs=(replace(pack, task_ids=frozenset({"t9"})),))) == (
        (), replace(snap, live_packs=(replace(pack, task_ids=frozenset({"t9"})),)))


H100_BYTES = 80 * 10**9  # what an 80 GB H100 reports, a little under DEFAULT_GPU_BYTES


def grid_task(n: int, model: str, batches: tuple[int, ...], seq_len: int, rows: int = 2000) -> tuple[PendingTrial, ...]:
    """One task's grid as `planner_io.build_snapshot` sees it: tokens per step = batch × max_seq_len, one epoch of
    `rows` rows, the task's default pack cap; learning rates and ranks cycle (the planner does not weigh them)."""
    return tuple(
        PendingTrial(trial_id=f"tr{i:02d}", task_id="t1", tenant_id="ten", base_model=model,
                     max_trials_per_pack=DEFAULT_MAX_TRIALS_PER_PACK, remaining_steps=-(-rows // batch),
                     tokens_per_step=batch * seq_len, lora_rank=(4, 16, 64)[i % 3])
        for i, batch in enumerate(batches[i % len(batches)] for i in range(n))
    )  # fmt: skip


@pytest.mark.parametrize(("batches", "seq_len"), [((4,), 96), ((4,), 128), ((4,), 512), ((4, 8, 16), 96),
                                                   ((4, 8, 16), 128)])
def test_the_first_plan_of_a_small_model_task_puts_every_trial_in_one_pack(batches: tuple[int, ...],
                                                                            seq_len: int) -> None:
    """Issue 15: an 18-trial SmolLM2-135M task (30 layers, hidden 576, intermediate 1536; ~100-token rows) on an idle
    H100, no measured costs yet. The packed engine steps 24 such trials in about the time of 8 (host-bound), so
    holding trials back for a later pack only makes the task slower; with early exit it also holds the warm-up
    ranking back. The plan from the cost priors must start all 18 now, in one pack (512: the API's default
    max_seq_len, which the planner counts in full): the bare priors, and the daemon's, which hold the model's weights
    (`prior_cost` of its registered size)."""
    snap = Snapshot(pending=grid_task(18, "smollm2-135m-instruct", batches, seq_len),
                    idle_workers=(LiveWorker("w0", DEFAULT_MAX_TRIALS_PER_PACK, H100_BYTES),))
    for costs in ({}, {"smollm2-135m-instruct": prior_cost(134_515_008)}):
        placement = place(snap, costs)
        (pack,) = placement.plan.packs
        assert (pack.worker_id, sorted(pack.trial_ids)) == ("w0", sorted(t.trial_id for t in snap.pending))
        assert placement.result is not None and len(placement.result.packs) == 1


def test_the_memory_prior_keeps_a_1b_model_from_over_packing() -> None:
    """The Llama-3.2-1B shape measured on the H100: 32 trials at batch 1 × 512 tokens peak at 46.9 GiB (one pack);
    at batch 4 they do not fit in 80 GB, so the first plan must not put all 32 in one pack."""
    idle = (LiveWorker("w0", DEFAULT_MAX_TRIALS_PER_PACK, H100_BYTES),)
    (pack,) = place(Snapshot(pending=grid_task(32, "llama-3.2-1b", (1,), 512), idle_workers=idle), {}).plan.packs
    assert len(pack.trial_ids) == 32
    (pack,) = place(Snapshot(pending=grid_task(32, "llama-3.2-1b", (4,), 512), idle_workers=idle), {}).plan.packs
    assert 1 <= len(pack.trial_ids) < 32
    assert len(pack.trial_ids) * 4 * 512 * PRIOR_COST.memory.k1_bytes_per_token <= H100_BYTES


def test_on_the_priors_no_trial_waits_for_a_later_pack_while_the_pack_starting_now_has_room() -> None:
    """Near the margin (13-step trials, whole time units) the objective on the priors still splits the task; the
    plan must not (`rules.fill_now`). With measured costs that say packing does not pay (a GPU-bound step that
    grows with every trial), the solver's choice to run the trials one pack after another stands."""
    pending = grid_task(18, "m", (4, 8, 16), 128, rows=50)
    idle = (LiveWorker("w0", DEFAULT_MAX_TRIALS_PER_PACK, H100_BYTES),)
    for priors in ({}, {"m": prior_cost(10**9)}):  # the bare priors, or the daemon's for a model of known size
        (pack,) = place(Snapshot(pending=pending, idle_workers=idle), priors).plan.packs
        assert len(pack.trial_ids) == 18
    gpu_bound = ModelCost(memory=PRIOR_COST.memory, step=StepTimeModel(a_s=0.001, b_s_per_token=1e-3, c_s_per_slot=0))
    placement = place(Snapshot(pending=pending, idle_workers=idle), {"m": gpu_bound})
    (pack,) = placement.plan.packs
    assert len(pack.trial_ids) < 18 and placement.result is not None and len(placement.result.packs) > 1


@pytest.mark.parametrize("solver", ["cpsat", "greedy"])
def test_the_room_beside_a_running_pack_takes_a_pack_of_another_model_now_on_that_worker(solver: Solver) -> None:
    """Issue 34: a worker running a pack of model "a" with room beside it (`beside_packs`, planned as a unit of its
    own) takes a pack of model "b" now, recorded on the worker itself; the running pack gets no back-fill in that
    round (the room beside it was what it left), and the trial of "a" waits."""
    member = RunningMember("r0", "ten", 1, 1000, 512)
    live = LivePack(pack_id="p-a", worker_id="w0", base_model="a", free_slots=4, members=1, max_rank=8,
                    target_modules=("all-linear",), tokens_per_step=512, busy_for_s=1000.0, member_list=(member,))
    busy = LiveWorker("w0", 8, 80 * 2**30, busy_for_s=1000.0)
    beside = LiveWorker("w0", 8, 40 * 2**30, frozenset({"b"}), beside_packs=True)
    snap = Snapshot(pending=(trial(0, model="b"), trial(1, model="a")), idle_workers=(beside,),
                    busy_workers=(busy,), live_packs=(live,))
    plan = place(snap, {}, solver=solver).plan
    assert [(p.worker_id, p.base_model, p.trial_ids) for p in plan.packs] == [("w0", "b", ("tr0",))]
    assert plan.backfills == ()
    # Without a pack of another model to start, the running pack takes its back-fill as before.
    alone = place(replace(snap, pending=(trial(1, model="a"),)), {}, solver=solver).plan
    assert alone.packs == () and [b.trial_ids for b in alone.backfills] == [("tr1",)]


@pytest.mark.parametrize("solver", ["cpsat", "greedy"])
def test_a_live_pack_whose_worker_is_not_planned_is_left_out_not_a_failed_round(solver: Solver) -> None:
    """Issue 53 (256 hollow workers): a scheduler behind its bus ignores stale heartbeats, so a worker can be out of
    the usable workers while its pack is still live. Every round then raised KeyError in both solvers and the
    scheduler fell further behind. The pack is left out of the plan (no back-fill for it); the rest is planned."""
    stale = live_pack("p-stale", frozenset({"t9"}), free=8)  # its worker w-p-stale is in neither worker list
    snap = Snapshot(pending=tuple(trial(i) for i in range(4)), idle_workers=(LiveWorker("w0", 8),),
                    busy_workers=(LiveWorker("w-p1", 8, None, busy_for_s=400.0),),
                    live_packs=(live_pack("p1", frozenset({"t1"}), free=2), stale))
    placement = place(snap, {}, solver=solver, time_limit_s=2.0)
    assert all(b.pack_id != "p-stale" for b in placement.plan.backfills)
    placed = [t for p in placement.plan.packs for t in p.trial_ids] + [
        t for b in placement.plan.backfills for t in b.trial_ids]
    assert sorted(placed) == [f"tr{i}" for i in range(4)]
