"""The CP-SAT planner against brute force on tiny instances, and its constraints on random ones."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import replace

from scheduler.planning.coefficients import SCALE, Prepared, finish_plan
from scheduler.planning.cost import MemoryModel, ModelCost, StepTimeModel
from scheduler.planning.cpsat import plan_cpsat
from scheduler.planning.greedy import plan_greedy
from scheduler.planning.rules import work_conserving
from scheduler.planning.types import (
    PendingTrial,
    PlanningInput,
    PlanResult,
    RunningMember,
    RunningPack,
    ScheduledPack,
    WorkerSpec,
)

GB = 10**9
COSTS = {
    "small": ModelCost(MemoryModel(10 * GB, 2e6), StepTimeModel(0.4, 1e-4, 0.05)),
    "big": ModelCost(MemoryModel(30 * GB, 5e6), StepTimeModel(1.0, 3e-4, 0.1)),
}


def trial(i: int, model: str = "small", *, steps: int = 100, tokens: int = 2000, tenant: str = "a", weight: int = 1,
          gpus: int = 1, cap: int = 4, slot: int = 10**8) -> PendingTrial:
    return PendingTrial(trial_id=f"t{i}", task_id=f"task{i % 2}", tenant_id=tenant, tenant_weight=weight,
                        base_model=model, gpus_needed=gpus, tokens_per_step=tokens, remaining_steps=steps,
                        slot_bytes=slot, max_trials_per_pack=cap)


# --- an independent re-implementation of the integer arithmetic, for the checks -------------------------------

def _mem(inp: PlanningInput, model: str, trials: list[PendingTrial], tokens: int = 0, slots: int = 0) -> int:
    m = inp.costs[model].memory
    return (math.ceil(m.k0_bytes) + math.ceil(m.k1_bytes_per_token * tokens) + slots
            + sum(math.ceil(m.k1_bytes_per_token * t.tokens_per_step) + t.slot_bytes for t in trials))


def _durations(inp: PlanningInput, model: str, trials: list[PendingTrial], running: RunningPack | None = None
               ) -> dict[str, int]:
    """Units from the pack's start to each member's last step, stepping the pack one step at a time: a step
    costs the base plus the item of every member still in it (a legacy running pack's load stays to the end).
    Covers a running pack's own members too when it lists them."""
    s, k = inp.costs[model].step, SCALE / inp.unit_s

    def item(tokens: int) -> int:
        return math.ceil(s.b_s_per_token * tokens * k) + math.ceil(s.c_s_per_slot * k)

    load = math.ceil(s.a_s * k)
    left = {t.trial_id: (t.remaining_steps, item(t.tokens_per_step)) for t in trials}
    if running and running.members:
        left |= {m.trial_id: (max(1, m.remaining_steps), item(m.tokens_per_step)) for m in running.members}
    elif running:
        load += math.ceil(s.b_s_per_token * running.tokens_per_step * k)
        load += math.ceil(s.c_s_per_slot * k) * running.trials
    clock, out = 0, {}
    for step in range(1, max((n for n, _ in left.values()), default=0) + 1):
        clock += load + sum(i for n, i in left.values() if n >= step)
        out |= {tid: max(1, -(-clock // SCALE)) for tid, (n, _) in left.items() if n == step}
    return out


def _loads(g: WorkerSpec, model: str) -> bool:
    return g.models is None or model in g.models


def check_valid(inp: PlanningInput, res: PlanResult) -> None:
    """Every constraint the planner promises, checked from scratch on its output."""
    by_id = {t.trial_id: t for t in inp.trials}
    gpu = {g.worker_id: g for g in inp.workers}
    running = {r.pack_id: r for r in inp.running}
    seen = [tid for p in res.packs for tid in p.trial_ids]
    assert len(seen) == len(set(seen))
    assert set(seen) | set(res.unschedulable) == set(by_id) and not set(seen) & set(res.unschedulable)
    busy: dict[str, list[tuple[int, int]]] = {g.worker_id: [] for g in inp.workers}
    spans: dict[str, list[tuple[int, int]]] = {}
    fills = {p.pack_key: [by_id[i] for i in p.trial_ids] for p in res.packs if p.backfill}
    run_end, theirs = {}, {}
    for r in inp.running:
        durs = _durations(inp, r.base_model, fills.get(r.pack_id, []), r)
        run_end[r.pack_id] = max(r.ends_at, *durs.values()) if durs else r.ends_at
        theirs |= {m.trial_id: durs[m.trial_id] for m in r.members}
        for m in r.members:
            spans.setdefault(m.tenant_id, []).append((0, durs[m.trial_id]))
        if not r.members:
            for ten, n in r.tenant_trials:
                spans.setdefault(ten, []).extend([(0, r.ends_at)] * n)
        for g in r.worker_ids:
            busy[g].append((0, max(run_end[r.pack_id], gpu[g].busy_until)))
    assert res.running_completion == theirs
    for p in res.packs:
        ts = [by_id[i] for i in p.trial_ids]
        assert {t.base_model for t in ts} == {p.base_model}
        assert len(ts) <= min(t.max_trials_per_pack for t in ts)
        assert len(set(p.worker_ids)) == len(p.worker_ids) and {t.gpus_needed for t in ts} == {len(p.worker_ids)}
        r = running.get(p.pack_key) if p.backfill else None
        if p.backfill:
            assert r is not None and p.start == 0 and set(p.worker_ids) == set(r.worker_ids)
            assert len(ts) <= r.free_slots and r.trials + len(ts) <= min(r.max_trials_per_pack,
                                                                          *(t.max_trials_per_pack for t in ts))
            mem = _mem(inp, p.base_model, ts, r.tokens_per_step, r.slot_bytes)
        else:
            assert p.start >= 0
            assert all(_loads(gpu[g], p.base_model) for g in p.worker_ids), "a GPU whose worker cannot load the model"
            mem = _mem(inp, p.base_model, ts)
        assert all(mem <= gpu[g].memory_bytes for g in p.worker_ids), "memory"
        durs = _durations(inp, p.base_model, ts, r)
        for t in ts:
            assert res.completion[t.trial_id] == p.start + durs[t.trial_id]
            spans.setdefault(t.tenant_id, []).append((p.start, p.start + durs[t.trial_id]))
        assert p.end == p.start + max(durs[t.trial_id] for t in ts)
        if not r:
            for g in p.worker_ids:
                busy[g].append((p.start, p.end))
    for spec in inp.workers:
        if spec.busy_until and not any(spec.worker_id in r.worker_ids for r in inp.running):
            busy[spec.worker_id].append((0, spec.busy_until))
        ivs = sorted(busy[spec.worker_id])
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ivs)), f"overlap on {spec.worker_id}: {ivs}"
    for ten, q in inp.tenant_quota.items():
        cap = max(q, sum(n for r in inp.running for t, n in r.tenant_trials if t == ten))
        ss = spans.get(ten, [])
        assert all(sum(1 for s, e in ss if s <= x < e) <= cap for x, _ in ss), f"quota of {ten}"
    assert res.makespan == max([*res.completion.values(), *run_end.values(), 0])
    weight = {t.trial_id: t.tenant_weight for t in inp.trials} | {m.trial_id: m.tenant_weight
                                                                   for r in inp.running for m in r.members}
    assert res.objective == inp.makespan_weight * res.makespan + sum(
        weight[i] * c for i, c in (dict(res.completion) | theirs).items())


# --- brute force ----------------------------------------------------------------------------------------------

def _partitions(items: list[PendingTrial]) -> Iterator[list[list[PendingTrial]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def brute_force(inp: PlanningInput) -> int:
    """Best objective over all packings, pack orders and GPU choices (left-shifted list schedules), and over
    which block (if any) back-fills the one running pack. No quotas."""
    best = math.inf
    # A trial no GPU set can hold even alone is left out (the planner reports it as unschedulable).
    placeable = [t for t in inp.trials if sum(_mem(inp, t.base_model, [t]) <= g.memory_bytes and _loads(g, t.base_model)
                                              for g in inp.workers) >= t.gpus_needed]
    (r,) = inp.running or (None,)
    weight = {t.trial_id: t.tenant_weight for t in inp.trials} | {m.trial_id: m.tenant_weight
                                                                   for m in (r.members if r else ())}
    for part in _partitions(placeable):
        if any(len({(t.base_model, t.gpus_needed) for t in p}) > 1 or len(p) > min(t.max_trials_per_pack for t in p)
               for p in part):
            continue
        fills: list[list[PendingTrial]] = [[]]
        if r:
            room = min(g.memory_bytes for g in inp.workers if g.worker_id in r.worker_ids)
            fills += [p for p in part
                      if {(t.base_model, t.gpus_needed) for t in p} == {(r.base_model, len(r.worker_ids))}
                      and len(p) <= r.free_slots and r.trials + len(p) <= min(r.max_trials_per_pack,
                                                                              *(t.max_trials_per_pack for t in p))
                      and _mem(inp, r.base_model, p, r.tokens_per_step, r.slot_bytes) <= room]
        for fill in fills:
            durs_r = _durations(inp, r.base_model, fill, r) if r else {}
            r_end = max([r.ends_at, *durs_r.values()]) if r else 0
            rest = [p for p in part if p is not fill]
            for order in itertools.permutations(rest):
                choices = [[c for c in itertools.combinations(inp.workers, p[0].gpus_needed)
                            if all(_mem(inp, p[0].base_model, list(p)) <= g.memory_bytes and _loads(g, p[0].base_model)
                                   for g in c)] for p in order]
                for pick in itertools.product(*choices):
                    avail = {g.worker_id: max(g.busy_until, r_end if r and g.worker_id in r.worker_ids else 0)
                             for g in inp.workers}
                    done = dict(durs_r)  # the back-filled trials and the running pack's own members
                    for p, gs in zip(order, pick, strict=True):
                        start = max(avail[g.worker_id] for g in gs)
                        durs = _durations(inp, p[0].base_model, list(p))
                        done.update({i: start + d for i, d in durs.items()})
                        for g in gs:
                            avail[g.worker_id] = start + max(durs.values())
                    makespan = max([*done.values(), r_end, 0])
                    best = min(best, inp.makespan_weight * makespan + sum(weight[i] * c for i, c in done.items()))
    return 0 if best == math.inf else int(best)


def test_tiny_instances_match_brute_force() -> None:
    rng = random.Random(7)
    for case in range(40):
        n, n_workers = rng.randint(1, 4), rng.randint(1, 2)
        trials = tuple(
            trial(i, rng.choice(["small", "big"]), steps=rng.randint(10, 400), tokens=rng.choice([500, 2000, 8000]),
                  weight=rng.randint(1, 3), gpus=rng.randint(1, n_workers), cap=rng.randint(1, 4))
            for i in range(n))
        gpus = tuple(WorkerSpec(f"g{j}", rng.choice([40, 80]) * GB, busy_until=rng.choice([0, 0, 20]))
                     for j in range(n_workers))
        inp = PlanningInput(trials, gpus, COSTS)
        res = plan_cpsat(inp, time_limit_s=5.0)
        check_valid(inp, res)
        assert res.status == "optimal", case
        assert res.objective == brute_force(inp), case


def random_instance(rng: random.Random) -> PlanningInput:
    n_workers, unit_s = rng.randint(1, 4), rng.choice([0.5, 1.0, 5.0])
    gpus = tuple(WorkerSpec(f"g{j}", rng.choice([24, 40, 80, 80]) * GB, busy_until=rng.choice([0, 0, 0, 15, 60]))
                 for j in range(n_workers))
    tenants = ["a", "b", "c"]
    trials = tuple(
        trial(i, rng.choice(["small", "big"]), steps=rng.randint(1, 300), tokens=rng.choice([256, 1024, 4096, 16384]),
              tenant=rng.choice(tenants), weight=rng.randint(1, 4), gpus=rng.choice([1, 1, 2]),
              cap=rng.randint(1, 6), slot=rng.choice([10**7, 10**8, 10**9]))
        for i in range(rng.randint(1, 7)))
    running: tuple[RunningPack, ...] = ()
    if rng.random() < 0.5:
        model = rng.choice(["small", "big"])
        running = (RunningPack("r0", ("g0",), model, rng.randint(1, 400), trials=1,
                               free_slots=rng.randint(0, 3), tokens_per_step=2048, slot_bytes=10**8,
                               max_trials_per_pack=4, tenant_trials=(("a", 1),)),)
        if rng.random() < 0.5:  # members known: the exact model, with the members' delays in the objective
            steps = rng.randint(1, 300)
            members = (RunningMember("m0", "a", rng.randint(1, 3), steps, 2048),)
            running = (replace(running[0], members=members, ends_at=_durations(
                PlanningInput((), gpus, COSTS, unit_s=unit_s), model, [], replace(running[0], members=members))["m0"]),)
    quota = {t: rng.randint(1, 3) for t in tenants if rng.random() < 0.4}
    return PlanningInput(trials, gpus, COSTS, running=running, tenant_quota=quota, unit_s=unit_s)


def test_tiny_instances_with_a_running_pack_match_brute_force() -> None:
    # Back-fill decisions against brute force: the running pack with its members listed (their delays count)
    # or as a legacy load that stays to its end.
    rng = random.Random(11)
    for case in range(30):
        trials = tuple(trial(i, rng.choice(["small", "small", "big"]), steps=rng.randint(10, 400),
                             tokens=rng.choice([500, 2000, 8000]), weight=rng.randint(1, 3), cap=rng.randint(2, 4))
                       for i in range(rng.randint(1, 4)))
        gpus = tuple(WorkerSpec(f"g{j}", 80 * GB) for j in range(rng.randint(1, 2)))
        run = RunningPack("r0", ("g0",), "small", rng.randint(20, 600), trials=1, free_slots=rng.randint(1, 3),
                          tokens_per_step=2000, slot_bytes=10**8, max_trials_per_pack=4)
        if rng.random() < 0.6:
            members = (RunningMember("m0", "a", rng.randint(1, 3), rng.randint(10, 600), 2000),)
            run = replace(run, members=members)
            run = replace(run, ends_at=_durations(PlanningInput((), gpus, COSTS), "small", [], run)["m0"])
        inp = PlanningInput(trials, gpus, COSTS, running=(run,))
        res = plan_cpsat(inp, time_limit_s=5.0)
        check_valid(inp, res)
        assert res.status == "optimal", case
        assert res.objective == brute_force(inp), case


def test_random_instances_never_violate_constraints() -> None:
    rng = random.Random(1234)
    for _ in range(50):
        inp = random_instance(rng)
        greedy = plan_greedy(inp)
        check_valid(inp, greedy)
        res = plan_cpsat(inp, time_limit_s=0.3)
        check_valid(inp, res)
        assert res.objective <= greedy.objective


MODEL_SETS = (None, None, frozenset({"small"}), frozenset({"big"}), frozenset(), frozenset({"small", "big"}))


def test_tiny_instances_with_workers_that_load_some_models_match_brute_force() -> None:
    # A GPU whose worker cannot load a model gets none of its packs; a trial whose model too few GPUs load is
    # unschedulable. CP-SAT's optimum is brute force's over the GPUs that load each pack's model.
    rng = random.Random(16)
    for case in range(40):
        n, n_workers = rng.randint(1, 4), rng.randint(1, 3)
        trials = tuple(
            trial(i, rng.choice(["small", "big"]), steps=rng.randint(10, 400), tokens=rng.choice([500, 2000, 8000]),
                  weight=rng.randint(1, 3), gpus=rng.choice([1, 1, n_workers]), cap=rng.randint(1, 4))
            for i in range(n))
        gpus = tuple(WorkerSpec(f"g{j}", rng.choice([40, 80]) * GB, busy_until=rng.choice([0, 0, 20]),
                             models=rng.choice(MODEL_SETS)) for j in range(n_workers))
        inp = PlanningInput(trials, gpus, COSTS)
        greedy = plan_greedy(inp)
        check_valid(inp, greedy)
        res = plan_cpsat(inp, time_limit_s=5.0)
        check_valid(inp, res)
        check_valid(inp, work_conserving(inp, res))
        assert res.status == "optimal", case
        assert res.objective == brute_force(inp), case
        assert set(res.unschedulable) == set(greedy.unschedulable)


def test_random_instances_with_workers_that_load_some_models_never_violate_constraints() -> None:
    rng = random.Random(4242)
    for _ in range(50):
        inp = random_instance(rng)
        inp = replace(inp, workers=tuple(replace(g, models=rng.choice(MODEL_SETS)) for g in inp.workers))
        greedy = plan_greedy(inp)
        check_valid(inp, greedy)
        res = plan_cpsat(inp, time_limit_s=0.3)
        check_valid(inp, res)
        check_valid(inp, work_conserving(inp, res))
        assert res.objective <= greedy.objective


def test_a_model_goes_only_to_gpus_whose_worker_can_load_it() -> None:
    # g0 is free now but loads only "small"; g1 loads every model but is busy for a while: the big trials wait
    # for g1 rather than start on g0, and a model that no GPU loads is not planned at all.
    gpus = (WorkerSpec("g0", 80 * GB, models=frozenset({"small"})), WorkerSpec("g1", 80 * GB, busy_until=50))
    inp = PlanningInput((trial(0, "big"), trial(1, "big"), trial(2, "small")), gpus, COSTS)
    for res in (plan_greedy(inp), plan_cpsat(inp), work_conserving(inp, plan_cpsat(inp))):
        check_valid(inp, res)
        assert {p.worker_ids for p in res.packs if p.base_model == "big"} == {("g1",)}
        assert all(p.start >= 50 for p in res.packs if p.base_model == "big")
    only_small = (WorkerSpec("g0", 80 * GB, models=frozenset({"small"})),)
    for res in (plan_greedy(replace(inp, workers=only_small)), plan_cpsat(replace(inp, workers=only_small))):
        assert set(res.unschedulable) == {"t0", "t1"} and [p.trial_ids for p in res.packs] == [("t2",)]


def test_greedy_fallback_when_the_model_is_too_big() -> None:
    inp = PlanningInput(tuple(trial(i) for i in range(6)), (WorkerSpec("g0", 80 * GB), WorkerSpec("g1", 80 * GB)),
                        COSTS, max_interval_vars=1)
    res = plan_cpsat(inp)
    assert res.status == "greedy_fallback"
    check_valid(inp, res)
    assert sorted(tid for p in res.packs for tid in p.trial_ids) == [f"t{i}" for i in range(6)]
    also = plan_cpsat(replace(inp, max_interval_vars=20_000, max_pack_terms=10))
    assert also.status == "greedy_fallback" and also.packs == res.packs


def test_greedy_fallback_when_the_solver_finds_nothing_in_time() -> None:
    inp = random_instance(random.Random(5))
    res = plan_cpsat(inp, time_limit_s=1e-9)
    check_valid(inp, res)
    assert res.status in ("greedy_fallback", "optimal")  # "optimal" only if nothing was left to decide


def test_backfills_a_running_packs_free_slot() -> None:
    # g0 is the only GPU and runs a long pack with a free slot: joining it beats waiting for it to end.
    running = RunningPack("r0", ("g0",), "small", ends_at=10_000, trials=1, free_slots=1, tokens_per_step=2000,
                          slot_bytes=10**8, max_trials_per_pack=4)
    inp = PlanningInput((trial(0), trial(1, "big")), (WorkerSpec("g0", 80 * GB),), COSTS, running=(running,))
    res = plan_cpsat(inp)
    check_valid(inp, res)
    fills = [p for p in res.start_now if p.backfill]
    assert [(p.pack_key, p.trial_ids) for p in fills] == [("r0", ("t0",))]
    assert res.completion["t1"] >= 10_000  # the other model waits for the GPU


def test_no_backfill_when_memory_does_not_fit() -> None:
    running = RunningPack("r0", ("g0",), "small", ends_at=50, trials=1, free_slots=3, tokens_per_step=2000,
                          slot_bytes=10**8, max_trials_per_pack=4)
    inp = PlanningInput((trial(0, slot=8 * GB),), (WorkerSpec("g0", 24 * GB),), COSTS, running=(running,))
    res = plan_cpsat(inp)
    check_valid(inp, res)
    assert not any(p.backfill for p in res.packs) and res.packs[0].start == 50


def test_multi_gpu_task_gets_its_gpus_together_and_unplaceable_trials_are_reported() -> None:
    gpus = tuple(WorkerSpec(f"g{j}", 80 * GB, busy_until=10 * j) for j in range(3))
    inp = PlanningInput((trial(0, "big", gpus=2), trial(1, "big", gpus=4), trial(2)), gpus, COSTS)
    res = plan_cpsat(inp)
    check_valid(inp, res)
    assert res.unschedulable == ("t1",)
    (pack,) = [p for p in res.packs if "t0" in p.trial_ids]
    assert len(pack.worker_ids) == 2 and pack.start >= 10


def test_same_input_and_seed_give_the_same_plan() -> None:
    inp = random_instance(random.Random(99))
    first, second = plan_cpsat(inp, seed=3), plan_cpsat(inp, seed=3)
    assert (first.packs, first.objective, first.status) == (second.packs, second.objective, second.status)


def test_nothing_pending_gives_an_empty_plan() -> None:
    res = plan_cpsat(PlanningInput((), (WorkerSpec("g0", 80 * GB),), COSTS))
    assert res.packs == () and res.start_now == () and res.makespan == 0


def test_trials_of_different_tenants_and_tasks_share_one_backbone() -> None:
    # A large fixed step cost (the frozen backbone's forward/backward) makes one shared pack the best plan.
    costs = {"small": ModelCost(MemoryModel(10 * GB, 1e6), StepTimeModel(2.0, 1e-5, 0.01))}
    trials = (trial(0, tenant="a"), trial(1, tenant="b"), trial(2, tenant="c"))
    inp = PlanningInput(trials, (WorkerSpec("g0", 80 * GB),), costs)
    res = plan_cpsat(inp)
    check_valid(inp, res)
    assert res.status == "optimal"
    assert [sorted(p.trial_ids) for p in res.start_now] == [["t0", "t1", "t2"]]


def test_quota_limits_concurrent_trials_of_a_tenant() -> None:
    costs = {"small": ModelCost(MemoryModel(10 * GB, 1e6), StepTimeModel(2.0, 1e-5, 0.01))}
    inp = PlanningInput(tuple(trial(i, tenant="a") for i in range(3)), (WorkerSpec("g0", 80 * GB),), costs,
                        tenant_quota={"a": 2})
    res = plan_cpsat(inp)
    check_valid(inp, res)
    assert max(len(p.trial_ids) for p in res.packs) == 2 and len(res.start_now) == 1


def test_backfill_respects_the_caps_counting_the_running_trials() -> None:
    # Two run already; the pending trials' own cap of 3 leaves room for one more, not for the 2 free slots.
    running = RunningPack("r0", ("g0",), "small", ends_at=10_000, trials=2, free_slots=2, tokens_per_step=2000,
                          slot_bytes=10**8, max_trials_per_pack=8)
    inp = PlanningInput((trial(0, cap=3), trial(1, cap=3)), (WorkerSpec("g0", 80 * GB),), COSTS, running=(running,))
    for res in (plan_greedy(inp), plan_cpsat(inp)):
        check_valid(inp, res)
        assert [len(p.trial_ids) for p in res.packs if p.backfill] == [1]


# --- work conservation: no GPU idle now while a pack waits -------------------------------------------------------

def _later_plan(inp: PlanningInput) -> PlanResult:
    """A plan that leaves g1 idle now: t0 starts on g0 now, t1 after it on g0, t2 on the busy g2 later."""
    t0, t1, t2 = (ScheduledPack(f"new-t{i}", (g,), "small", (f"t{i}",), start, 0)
                  for i, g, start in ((0, "g0", 0), (1, "g0", 500), (2, "g2", 300)))
    return finish_plan(Prepared(inp), [t0, t1, t2], 0.0, "feasible")


def test_work_conserving_starts_the_earliest_waiting_pack_on_an_idle_gpu_now() -> None:
    gpus = (WorkerSpec("g0", 80 * GB), WorkerSpec("g1", 80 * GB), WorkerSpec("g2", 80 * GB, busy_until=300))
    inp = PlanningInput(tuple(trial(i) for i in range(3)), gpus, COSTS)
    before = _later_plan(inp)
    after = work_conserving(inp, before)
    assert sorted((p.pack_key, p.worker_ids, p.start) for p in after.start_now) == [
        ("new-t0", ("g0",), 0), ("new-t2", ("g1",), 0)]  # t2 (earliest later) moved to the idle g1
    assert after.completion["t2"] < before.completion["t2"]
    assert all(after.completion[t] <= before.completion[t] for t in before.completion)
    # Nothing idle, or nothing waiting: the plan as it was.
    busy = replace(inp, workers=(gpus[0], replace(gpus[1], busy_until=10), gpus[2]))
    assert work_conserving(busy, _later_plan(busy)) == _later_plan(busy)


def test_work_conserving_respects_memory_and_quotas() -> None:
    gpus = (WorkerSpec("g0", 80 * GB), WorkerSpec("g1", 11 * GB), WorkerSpec("g2", 80 * GB, busy_until=300))
    inp = PlanningInput(tuple(trial(i) for i in range(3)), gpus, COSTS)
    # g1 cannot hold a pack of "small" (10 GB base + 2e6 x 2000 tokens per trial): nothing moves.
    assert work_conserving(inp, _later_plan(inp)) == _later_plan(inp)
    roomy = replace(inp, workers=(gpus[0], replace(gpus[1], memory_bytes=80 * GB), gpus[2]))
    # Tenant "a" may run one trial at a time: t0 runs now, so neither waiting pack may start beside it.
    capped = replace(roomy, tenant_quota={"a": 1})
    assert work_conserving(capped, _later_plan(capped)) == _later_plan(capped)
    assert work_conserving(replace(roomy, tenant_quota={"a": 2}), _later_plan(roomy)).start_now != _later_plan(
        roomy).start_now
