"""The simulator's yardsticks (scheduler/sim/bounds.py): lower bounds no policy beats, and the share gap."""

from __future__ import annotations

import pytest

from scheduler.planning.cost import MemoryModel, ModelCost, StepTimeModel
from scheduler.planning.fairness import FairnessPolicy
from scheduler.sim.bounds import makespan_lower_bound, share_deviations, share_gap_max
from scheduler.sim.simulate import POLICIES, PackRecord, SimResult, simulate
from scheduler.sim.traces import Trace, TraceTask, TraceTrial, contended, tenant_stream

GB = 10**9
# A step of 1 s per member and nothing shared (a = 0): a trial of n steps is n GPU seconds alone or packed.
FLAT = {"m": ModelCost(MemoryModel(GB, 0.0), StepTimeModel(0.0, 0.0, 1.0))}


def task(name: str, steps: int, arrival_s: float = 0.0, tenant: str = "ten", weight: int = 1) -> TraceTask:
    return TraceTask(name, tenant, weight, "m", 1, arrival_s, (TraceTrial(f"{name}-0", 100, steps, 1, 8),))


def test_makespan_bound_hand_computed() -> None:
    trace = Trace("lb", (task("A", 100), task("B", 100), task("C", 10)), FLAT)
    assert makespan_lower_bound(trace, 2) == pytest.approx(105)  # 210 GPU seconds over 2 GPUs
    assert makespan_lower_bound(trace, 1) == pytest.approx(210)
    assert makespan_lower_bound(trace, 8) == pytest.approx(100)  # A alone takes 100 s
    # A late arrival: it ends no sooner than 200 + 50, measured from the first arrival.
    late = Trace("late", (task("A", 100), task("D", 50, arrival_s=200.0)), FLAT)
    assert makespan_lower_bound(late, 2) == pytest.approx(250)
    assert makespan_lower_bound(Trace("none", (), FLAT), 2) == 0.0


@pytest.mark.parametrize("preempt", [False, True])
def test_no_policy_beats_the_makespan_lower_bound(preempt: bool) -> None:
    fairness = FairnessPolicy() if preempt else None
    for seed in range(3):
        for trace in (tenant_stream(seed, 2, tasks=12, load=3.0), contended(seed, 2, tasks=9)):
            bound = makespan_lower_bound(trace, 2)
            assert bound > 0
            for policy in POLICIES:
                result = simulate(trace, 2, policy, time_limit_s=0.2, fairness=fairness)
                assert result.makespan_s >= bound * (1 - 1e-9), (trace.name, seed, policy)


def result(packs: tuple[PackRecord, ...], completed: dict[str, float]) -> SimResult:
    return SimResult(policy="hand", trace="hand", gpus=2, makespan_s=max(completed.values()), mean_jct_s=0.0,
                     p95_jct_s=0.0, gpu_util=1.0, replan_p95_ms=0.0, replans=0, unschedulable=(), statuses={},
                     started_s={}, completed_s=completed, steps_done={}, packs=packs)


def test_share_gap_against_hand_computed_weighted_shares() -> None:
    # Two tenants, each with one trial on a GPU of its own for two hours: equal GPU time.
    packs = (PackRecord("p1", ("g0",), "m", 0.0, 7200.0, ((0.0, ("A-0",)), (7200.0, ()))),
             PackRecord("p2", ("g1",), "m", 0.0, 7200.0, ((0.0, ("B-0",)), (7200.0, ()))))
    done = result(packs, {"A-0": 7200.0, "B-0": 7200.0})
    equal = Trace("eq", (task("A", 7200, tenant="a"), task("B", 7200, tenant="b")), FLAT)
    assert share_deviations(equal, done, 3600.0) == [0.0, 0.0]  # two windows, each on its shares
    # With weights 1 and 3 the targets are 1/4 and 3/4: half each is 100% over a's target, a third under b's.
    weighted = Trace("w", (task("A", 7200, tenant="a"), task("B", 7200, tenant="b", weight=3)), FLAT)
    assert share_gap_max(weighted, done, 3600.0) == pytest.approx(1.0)
    # One tenant backlogged: no window to judge.
    alone = Trace("one", (task("A", 7200, tenant="a"),), FLAT)
    assert share_gap_max(alone, result(packs[:1], {"A-0": 7200.0}), 3600.0) is None
