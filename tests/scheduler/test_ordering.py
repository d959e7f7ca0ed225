"""What the planners promise about order: Smith's rule (shortest solo time per unit of weight first) in the
greedy plan and its CP-SAT refinement, and that a back-fill pays for the running members it slows."""

from __future__ import annotations

import random
from dataclasses import replace

from scheduler.planning.coefficients import NEVER, SCALE, Member, Prepared, completions
from scheduler.planning.cost import MemoryModel, ModelCost, StepTimeModel
from scheduler.planning.cpsat import plan_cpsat
from scheduler.planning.greedy import plan_greedy
from scheduler.planning.types import PendingTrial, PlanningInput, RunningMember, RunningPack, WorkerSpec
from tests.scheduler.test_cpsat import check_valid

GB = 10**9
# a = 0.2 s shared, b·tokens + c per member: packing shares little, as for the tenant stream's 8B jobs.
COSTS = {"m": ModelCost(MemoryModel(10 * GB, 1e6), StepTimeModel(0.2, 1e-4, 0.01)),
         "n": ModelCost(MemoryModel(20 * GB, 2e6), StepTimeModel(0.3, 2e-4, 0.01))}


def trial(i: int, steps: int, *, model: str = "m", tokens: int = 2000, weight: int = 1, cap: int = 8,
          tenant: str = "a") -> PendingTrial:
    return PendingTrial(trial_id=f"t{i}", task_id=f"task{i}", tenant_id=tenant, tenant_weight=weight, base_model=model,
                        tokens_per_step=tokens, remaining_steps=steps, slot_bytes=10**8, max_trials_per_pack=cap)


def test_completions_match_stepping_the_pack_one_step_at_a_time() -> None:
    rng = random.Random(3)
    for _ in range(200):
        base = rng.randint(0, 50)
        members = [Member(f"u{i}", rng.choice([1, 5, 17, 40, 40, NEVER]), rng.randint(0, 900), 1)
                   for i in range(rng.randint(1, 5))]
        finite = [m for m in members if m.steps < NEVER]
        clock, want = 0, dict[str, int]()
        for step in range(1, max((m.steps for m in finite), default=0) + 1):
            clock += base + sum(m.item for m in members if m.steps >= step)
            want |= {m.trial_id: max(1, -(-clock // SCALE)) for m in finite if m.steps == step}
        assert completions(base, members) == want


def test_priority_is_smiths_rule_with_ties_in_arrival_order() -> None:
    trials = (trial(0, 300), trial(1, 100), trial(2, 300, weight=3), trial(3, 100), trial(4, 100, tokens=8000))
    inp = PlanningInput(trials, (WorkerSpec("g0", 80 * GB),), COSTS)
    prep = Prepared(inp)
    # t2 is 3x as long as t1/t3 at 3x the weight: equal key, so arrival order decides among the three.
    assert [t.trial_id for t in prep.priority()] == ["t1", "t2", "t3", "t4", "t0"]


def random_identical(rng: random.Random, cap_one: bool) -> PlanningInput:
    trials = tuple(trial(i, rng.randint(1, 2000), model=rng.choice(["m", "n"]), tokens=rng.choice([512, 2048, 8192]),
                         weight=rng.choice([1, 1, 2, 3]), cap=1 if cap_one else rng.randint(1, 8))
                   for i in range(rng.randint(2, 40)))
    return PlanningInput(trials, tuple(WorkerSpec(f"g{j}", 80 * GB) for j in range(rng.randint(1, 6))), COSTS)


def test_greedy_opens_packs_in_smiths_order() -> None:
    # Identical GPUs, one GPU per trial, no quotas: every trial that opens a pack starts no earlier than every
    # trial before it in Smith's order that opened one (each takes the earliest-free GPU, and GPUs only fill).
    # Trials that join a pack start with it, earlier: that is what packing is for.
    rng = random.Random(5)
    for _ in range(60):
        inp = random_identical(rng, cap_one=False)
        res = plan_greedy(inp)
        check_valid(inp, res)
        leaders = {p.trial_ids[0]: p.start for p in res.packs if not p.backfill}
        starts = [leaders[t.trial_id] for t in Prepared(inp).priority() if t.trial_id in leaders]
        assert starts == sorted(starts)


def test_without_packing_a_shorter_trial_never_starts_after_a_longer_one() -> None:
    # Cap 1 (no packing), equal weights, identical GPUs: greedy is SPT list scheduling.
    rng = random.Random(6)
    for _ in range(60):
        inp = random_identical(rng, cap_one=True)
        inp = replace(inp, trials=tuple(replace(t, tenant_weight=1) for t in inp.trials))
        res = plan_greedy(inp)
        check_valid(inp, res)
        prep = Prepared(inp)
        start = {i: p.start for p in res.packs for i in p.trial_ids}
        for a in prep.trials:
            for b in prep.trials:
                if prep.solo_milli(a) < prep.solo_milli(b):
                    assert start[a.trial_id] <= start[b.trial_id]


def test_cpsat_on_one_gpu_orders_by_smiths_rule() -> None:
    # One machine, no packing: Smith's order is the unique optimum when the ratios differ, and CP-SAT finds it.
    rng = random.Random(8)
    for _ in range(10):
        trials = tuple(trial(i, rng.randint(5, 500), weight=rng.randint(1, 4), cap=1) for i in range(6))
        inp = PlanningInput(trials, (WorkerSpec("g0", 80 * GB),), COSTS, makespan_weight=rng.choice([0, 1, 5]))
        prep = Prepared(inp)
        keys = [prep.solo_milli(t) / t.tenant_weight for t in prep.trials]
        if len(set(keys)) < len(keys):
            continue
        res = plan_cpsat(inp, time_limit_s=5.0)
        check_valid(inp, res)
        assert res.status == "optimal"
        by_start = [p.trial_ids[0] for p in sorted(res.packs, key=lambda p: p.start)]
        assert by_start == [t.trial_id for t in prep.priority()]


def running(steps: int, weight: int = 1) -> RunningPack:
    """One GPU, busy with one long member (known to the planner) that has room for more."""
    return RunningPack("r0", ("g0",), "m", ends_at=0, trials=1, free_slots=7, tokens_per_step=2000, slot_bytes=10**8,
                       max_trials_per_pack=8, members=(RunningMember("long", "b", weight, steps, 2000),))


def test_a_short_trial_slips_into_a_running_pack_rather_than_wait_behind_it() -> None:
    # Waiting for the long member (~4,200 units) costs far more than sharing its step for ~42 units.
    inp = PlanningInput((trial(0, 100),), (WorkerSpec("g0", 80 * GB),), COSTS, running=(running(10_000),))
    for res in (plan_greedy(inp), plan_cpsat(inp)):
        check_valid(inp, res)
        assert [(p.pack_key, p.trial_ids) for p in res.start_now] == [("r0", ("t0",))]
        assert res.running_completion["long"] > Prepared(inp).running_end(inp.running[0])  # it was slowed


def test_a_backfill_pays_for_the_members_it_slows() -> None:
    # A large shared step cost (a = 1 s, the member's own 0.21 s): the pending trial, longer than the running
    # member's rest, finishes 50 units sooner by sharing (it saves the shared cost of the member's 50 steps),
    # and delays the member by 50 · 0.21 = 10.5 units. Worth it when the member weighs 1, not when it weighs 8.
    costs = {"m": ModelCost(MemoryModel(10 * GB, 1e6), StepTimeModel(1.0, 1e-4, 0.01))}
    for weight, backfill in ((1, True), (8, False)):
        pack = running(50, weight)
        pack = replace(pack, ends_at=Prepared(PlanningInput((), (), costs, running=(pack,))).running_end(pack))
        inp = PlanningInput((trial(0, 5_000),), (WorkerSpec("g0", 80 * GB),), costs, running=(pack,), makespan_weight=0)
        for res in (plan_greedy(inp), plan_cpsat(inp)):
            check_valid(inp, res)
            assert any(p.backfill for p in res.packs) == backfill, (weight, res.status)
