"""The trace-driven simulator: invariants on small random traces, a hand-computed FIFO run, and the CLI."""

from __future__ import annotations

import json
import math
import random

import pytest

from loraplane.cli import main
from scheduler.planning.cost import MemoryModel, ModelCost, StepTimeModel
from scheduler.planning.fairness import FairnessPolicy
from scheduler.sim.bounds import mean_jct_lower_bound
from scheduler.sim.simulate import POLICIES, SimResult, percentile, simulate
from scheduler.sim.traces import Trace, TraceTask, TraceTrial, alto_mix, contended, shared_gpu, tenant_stream

GB = 10**9
COSTS = {
    "small": ModelCost(MemoryModel(10 * GB, 2e6), StepTimeModel(0.4, 1e-4, 0.05)),
    "big": ModelCost(MemoryModel(30 * GB, 5e6), StepTimeModel(1.0, 3e-4, 0.1)),
}


def random_trace(seed: int) -> Trace:
    rng = random.Random(seed)
    tasks = []
    for i in range(rng.randint(3, 6)):
        model, gpus = rng.choice([("small", 1), ("small", 1), ("big", 2)])
        trials = tuple(TraceTrial(f"t{i}-{j}", rng.choice([500, 2000, 8000]), rng.randint(5, 400),
                                  rng.choice([10**8, 10**9]), rng.choice([1, 2, 4]))
                       for j in range(rng.randint(1, 3)))
        tasks.append(TraceTask(f"task{i}", f"ten{i % 2}", rng.choice([1, 2]), model, gpus,
                               float(rng.choice([0, 0, 30, 200])), trials))
    # One trial no GPU can hold: it must be reported, not looped on.
    tasks.append(TraceTask("huge", "ten0", 1, "big", 2, 5.0, (TraceTrial("huge-0", 10**6, 10, 10**8, 4),)))
    return Trace("random", tuple(sorted(tasks, key=lambda t: t.arrival_s)), COSTS, gpu_memory_bytes=80 * GB)


def check_invariants(trace: Trace, gpus: int, r: SimResult, max_pauses: int = 0) -> None:
    trials = {tr.trial_id: (t, tr) for t in trace.tasks for tr in t.trials}
    assert r.unschedulable == ("huge-0",)
    placeable = set(trials) - set(r.unschedulable)
    assert set(r.completed_s) == placeable
    # Each trial ran in exactly one pack, entering once; preempted, in one more pack per pause.
    entries = [i for p in r.packs for i in set().union(*(set(m) for _, m in p.members))]
    if not max_pauses:
        assert sorted(entries) == sorted(placeable)
    assert set(entries) == placeable and all(1 <= entries.count(i) <= 1 + max_pauses for i in placeable)
    assert sum(entries.count(i) - 1 for i in placeable) >= r.preempted  # a preempted pack had ≥ 1 member
    for i in placeable:
        task, tr = trials[i]
        assert r.steps_done[i] == tr.steps
        assert task.arrival_s <= r.started_s[i] < r.completed_s[i]
        # Alone at full speed it needs steps·step_s; sharing a pack can only slow it down.
        solo = tr.steps * trace.costs[task.base_model].step.predict(tr.tokens_per_step, 1)
        assert r.completed_s[i] - r.started_s[i] >= solo * (1 - 1e-9)
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for p in r.packs:
        assert p.start_s < p.end_s and p.members[-1][1] == ()
        for g in p.worker_ids:
            by_gpu.setdefault(g, []).append((p.start_s, p.end_s))
        cost = trace.costs[p.base_model].memory
        for _, members in p.members:
            specs = [trials[i][1] for i in members]
            assert {trials[i][0].base_model for i in members} <= {p.base_model}
            assert all(trials[i][0].gpus_needed == len(p.worker_ids) for i in members)
            mem = cost.k0_bytes + sum(cost.k1_bytes_per_token * s.tokens_per_step + s.slot_bytes for s in specs)
            assert mem <= trace.gpu_memory_bytes
            assert len(members) <= min([s.max_trials_per_pack for s in specs], default=1)
            if r.policy == "fifo":
                assert len(members) <= 1
    assert len(by_gpu) <= gpus
    for spans in by_gpu.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert 0 < r.gpu_util <= 1 + 1e-9
    assert r.makespan_s == pytest.approx(max(r.completed_s.values()) - trace.tasks[0].arrival_s)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_invariants_on_random_traces(policy: str, seed: int) -> None:
    trace = random_trace(seed)
    gpus = 2 + seed % 3
    check_invariants(trace, gpus, simulate(trace, gpus, policy, time_limit_s=0.2))


@pytest.mark.parametrize("policy", ["greedy", "cpsat"])
@pytest.mark.parametrize("seed", range(4))
def test_invariants_hold_with_preemption(policy: str, seed: int) -> None:
    # A short slice, so that the small random traces preempt at all; a trial still trains every step, once.
    fairness = FairnessPolicy(min_slice_s=20.0, window_s=600.0, max_pauses=2)
    trace = random_trace(seed)
    gpus = 2 + seed % 3
    r = simulate(trace, gpus, policy, time_limit_s=0.2, fairness=fairness, pause_cost_s=5.0)
    check_invariants(trace, gpus, r, max_pauses=fairness.max_pauses)


def test_preemption_happens_on_the_shared_gpu_trace() -> None:
    trace = shared_gpu(0, 2, tasks=30)
    assert {t.tenant_weight for t in trace.tasks if t.tenant_id == "tenant2"} == {2}
    today, fair = simulate(trace, 2, "greedy"), simulate(trace, 2, "greedy", fairness=FairnessPolicy())
    assert today.preempted == 0 < fair.preempted
    assert fair.steps_done == today.steps_done  # every trial trains all its steps either way


def test_the_contended_trace_asks_each_tenant_for_about_the_same_gpu_time() -> None:
    trace = contended(0, 2, tasks=300)
    demand: dict[str, float] = {}
    for t in trace.tasks:
        step = trace.costs[t.base_model].step
        demand[t.tenant_id] = demand.get(t.tenant_id, 0.0) + sum(
            tr.steps * step.predict(tr.tokens_per_step, 1) for tr in t.trials)
    assert len({t.base_model for t in trace.tasks}) == 3 and sorted(demand) == ["tenant0", "tenant1", "tenant2"]
    assert max(demand.values()) / min(demand.values()) < 1.25


def test_fifo_hand_computed() -> None:
    # Step time 1 s whatever the pack (a = 1, b = c = 0), so a trial takes its step count in seconds.
    costs = {"m": ModelCost(MemoryModel(GB, 0.0), StepTimeModel(1.0, 0.0, 0.0))}

    def task(name: str, arrival: float, steps: int, gpus: int = 1) -> TraceTask:
        return TraceTask(name, "ten", 1, "m", gpus, arrival, (TraceTrial(f"{name}-0", 100, steps, 1, 8),))

    # 2 GPUs: A [0, 100) on one, B [0, 50) on the other; C arrives at 10 and waits for B: [50, 80).
    # D needs both GPUs and arrives at 20 behind C: it waits for A, [100, 140). E (1 GPU, arrives at 30) is
    # stuck behind D under strict FCFS although a GPU is free from 80: [140, 150).
    trace = Trace("hand", (task("A", 0, 100), task("B", 0, 50), task("C", 10, 30), task("D", 20, 40, gpus=2),
                           task("E", 30, 10)), costs)
    r = simulate(trace, 2, "fifo")
    assert r.completed_s == pytest.approx({"A-0": 100, "B-0": 50, "C-0": 80, "D-0": 140, "E-0": 150})
    assert r.makespan_s == pytest.approx(150)
    jcts = [100, 50, 70, 120, 120]
    assert r.mean_jct_s == pytest.approx(sum(jcts) / 5)
    assert r.p95_jct_s == pytest.approx(120)
    assert r.gpu_util == pytest.approx((100 + 50 + 30 + 2 * 40 + 10) / (2 * 150))


def test_packing_shares_the_step_and_speeds_up_when_a_member_leaves() -> None:
    # a = 1 s, b = 1 ms per token: two 1000-token trials together step in 3 s, one alone in 2 s.
    costs = {"m": ModelCost(MemoryModel(GB, 0.0), StepTimeModel(1.0, 1e-3, 0.0))}
    trials = (TraceTrial("x", 1000, 10, 1, 8), TraceTrial("y", 1000, 20, 1, 8))
    trace = Trace("pair", (TraceTask("t", "ten", 1, "m", 1, 0.0, trials),), costs)
    r = simulate(trace, 1, "greedy")
    # Together for 10 steps (30 s), then y alone for 10 more steps at 2 s.
    assert r.completed_s == pytest.approx({"x": 30, "y": 50})
    assert len(r.packs) == 1


def _one_gpu_trace(*jobs: tuple[str, float, int]) -> Trace:
    """Single-trial tasks (name, arrival, steps), one trial per pack, whose step takes 1 s."""
    costs = {"m": ModelCost(MemoryModel(GB, 0.0), StepTimeModel(1.0, 0.0, 0.0))}
    return Trace("hand", tuple(TraceTask(n, "ten", 1, "m", 1, a, (TraceTrial(f"{n}-0", 100, steps, 1, 1),))
                               for n, a, steps in jobs), costs)


@pytest.mark.parametrize("policy", ["greedy", "cpsat"])
def test_shortest_waiting_job_goes_first_hand_computed(policy: str) -> None:
    # One GPU, one trial per pack: A [0, 100); at 100 B (50 s, waiting since 10) and C (10 s, since 20) wait:
    # C goes first [100, 110), then B [110, 160). JCTs 100, 150, 90; fifo runs B before C: 100, 140, 140.
    trace = _one_gpu_trace(("A", 0, 100), ("B", 10, 50), ("C", 20, 10))
    r = simulate(trace, 1, policy, time_limit_s=0.5)
    assert r.completed_s == pytest.approx({"A-0": 100, "B-0": 160, "C-0": 110})
    assert r.mean_jct_s == pytest.approx((100 + 150 + 90) / 3)
    assert r.p95_jct_s == pytest.approx(150)
    assert simulate(trace, 1, "fifo").mean_jct_s == pytest.approx((100 + 140 + 140) / 3)


@pytest.mark.parametrize("policy", ["greedy", "cpsat"])
def test_short_job_shares_a_long_jobs_pack_instead_of_waiting(policy: str) -> None:
    # a = 0.5 s shared, 0.5 s per member: L alone steps in 1 s, L and S together in 1.5 s. S (10 steps)
    # arrives at 1 while L has 999 steps left: sharing costs S 15 s and L 5 s; waiting costs S 999 s.
    costs = {"m": ModelCost(MemoryModel(GB, 0.0), StepTimeModel(0.5, 0.0, 0.5))}
    trace = Trace("ps", (TraceTask("L", "ten", 1, "m", 1, 0.0, (TraceTrial("L-0", 100, 1000, 1, 8),)),
                         TraceTask("S", "ten", 1, "m", 1, 1.0, (TraceTrial("S-0", 100, 10, 1, 8),))), costs)
    r = simulate(trace, 1, policy, time_limit_s=0.5)
    assert r.completed_s == pytest.approx({"S-0": 16, "L-0": 1005})
    assert len(r.packs) == 1


def test_no_policy_beats_the_mean_jct_lower_bound() -> None:
    for seed in range(3):
        for load in (0.5, 3.0):
            trace = tenant_stream(seed, 2, tasks=12, load=load)
            bound = mean_jct_lower_bound(trace, 2)
            assert bound > 0
            for policy in POLICIES:
                assert simulate(trace, 2, policy, time_limit_s=0.2).mean_jct_s >= bound * (1 - 1e-9)


def test_lower_bound_hand_computed() -> None:
    # Two 100 s jobs and a 10 s one at 0 on 2 GPUs, no shared step cost (a = 0): per-job bound (100+100+10)/3;
    # the 2x-fast machine bound: 10 s job at 5, then the two at 55 and 105: (5 + 55 + 105)/3 = 55 < 70.
    costs = {"m": ModelCost(MemoryModel(GB, 0.0), StepTimeModel(0.0, 0.0, 1.0))}
    trace = Trace("lb", tuple(TraceTask(n, "ten", 1, "m", 1, 0.0, (TraceTrial(f"{n}-0", 100, s, 1, 8),))
                              for n, s in (("A", 100), ("B", 100), ("C", 10))), costs)
    assert mean_jct_lower_bound(trace, 2) == pytest.approx(70)
    # On one GPU the fast machine is the GPU itself: SRPT ends them at 10, 110, 210, mean 110 > 70.
    assert mean_jct_lower_bound(trace, 1) == pytest.approx(110)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 95) == 0
    assert percentile([3, 1, 2], 50) == 2
    assert percentile(list(range(1, 101)), 95) == 95


def test_traces_are_deterministic_and_plausible() -> None:
    a, b = alto_mix(3), alto_mix(3)
    assert a == b and len(a.tasks) == 11
    assert sorted(t.gpus_needed for t in a.tasks) == [1] * 6 + [2] * 3 + [4] * 2
    for t in a.tasks:
        cost = a.costs[t.base_model]
        for tr in t.trials:
            # Every trial fits alone on an 80 GB GPU, and steps take between 10 ms and a minute.
            assert cost.memory.k0_bytes + cost.memory.k1_bytes_per_token * tr.tokens_per_step + tr.slot_bytes < 80 * GB
            assert 0.01 < cost.step.predict(tr.tokens_per_step, 1) < 60
    s = tenant_stream(1, 4, tasks=30)
    assert s == tenant_stream(1, 4, tasks=30) and len(s.tasks) == 30
    arrivals = [t.arrival_s for t in s.tasks]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    assert math.isclose(len({t.tenant_id for t in s.tasks}) / 8, 1, abs_tol=0.5)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    main(["simulate", "--trace", "tenant-stream", "--gpus", "3", "--tasks", "12", "--seed", "2",
          "--policy", "fifo,greedy,cpsat", "--time-limit", "0.2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [o["policy"] for o in out] == ["fifo", "greedy", "cpsat"]
    keys = {"policy", "trace", "gpus", "makespan_s", "mean_jct_s", "p95_jct_s", "gpu_util", "replan_p95_ms",
            "makespan_lower_bound_s", "mean_jct_lower_bound_s", "share_gap_max"}
    for o in out:
        assert keys <= set(o) and o["trace"] == "tenant-stream" and o["gpus"] == 3
        assert o["makespan_s"] > 0 and o["mean_jct_s"] > 0 and 0 < o["gpu_util"] <= 1
        # The bounds are the trace's: the same beside every policy, and none beats them.
        assert 0 < o["makespan_lower_bound_s"] <= o["makespan_s"] * (1 + 1e-6)
        assert 0 < o["mean_jct_lower_bound_s"] <= o["mean_jct_s"] * (1 + 1e-6)
    assert len({(o["makespan_lower_bound_s"], o["mean_jct_lower_bound_s"]) for o in out}) == 1


def test_cli_preempts_by_default_as_the_scheduler_does(capsys: pytest.CaptureFixture[str]) -> None:
    """With no flags each policy runs as the daemon runs it by default: LORAPLANE_PREEMPT is on, so preemption is."""
    args = ["simulate", "--trace", "shared-gpu", "--gpus", "2", "--tasks", "30", "--policy", "greedy", "--json"]
    main(args)
    [default] = json.loads(capsys.readouterr().out)
    main([*args, "--no-preempt"])
    [off] = json.loads(capsys.readouterr().out)
    assert default["preempted"] > 0 and off["preempted"] == 0


def test_cli_load_scales_arrivals_only(capsys: pytest.CaptureFixture[str]) -> None:
    out = {}
    for load in ("0.9", "3"):
        main(["simulate", "--trace", "tenant-stream", "--gpus", "2", "--tasks", "10", "--load", load,
              "--policy", "fifo", "--json"])
        out[load] = json.loads(capsys.readouterr().out)[0]
    assert out["3"]["mean_jct_s"] > out["0.9"]["mean_jct_s"] and out["3"]["makespan_weight"] == 0
    assert tenant_stream(0, 2, tasks=10, load=3).tasks[-1].arrival_s == pytest.approx(
        tenant_stream(0, 2, tasks=10, load=0.9).tasks[-1].arrival_s * 0.3)
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", "alto-mix", "--load", "2"])


def test_cli_preempt_on_the_shared_gpu_trace(capsys: pytest.CaptureFixture[str]) -> None:
    main(["simulate", "--trace", "shared-gpu", "--gpus", "2", "--tasks", "30", "--policy", "greedy", "--preempt",
          "--json"])
    [out] = json.loads(capsys.readouterr().out)
    assert out["trace"] == "shared-gpu" and out["preempted"] > 0


def test_cli_rejects_unknown_policy() -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--policy", "fifo,lifo"])
