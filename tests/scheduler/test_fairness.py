"""The preemption rule (scheduler/planning/fairness.py, pure) and the simulator that applies it: which pack gives
up its GPU to whom, the bounds on it (slice, pauses, the waiting tenant's share), and what it does to a short task
stuck behind a long pack of another model."""

from __future__ import annotations

import pytest

from scheduler.planning.fairness import (
    FairnessPolicy,
    PackView,
    WaitingTrial,
    normalised_usage,
    preemptions,
    usage_in_window,
)
from scheduler.sim.simulate import simulate
from scheduler.sim.traces import Trace, TraceTask, TraceTrial, model_cost, slot_bytes

POLICY = FairnessPolicy(min_slice_s=300, window_s=3600, max_pauses=2)


def pack(pack_id: str, tenants: set[str], running_s: float = 600, pauses: tuple[int, ...] = (0,),
         gpus: int = 1) -> PackView:
    return PackView(pack_id, gpus, running_s, frozenset(tenants), pauses)


def test_a_tenant_below_its_share_takes_the_gpu_of_the_tenant_most_ahead() -> None:
    usage = {"big": 3000.0, "mid": 1000.0, "small": 0.0}
    chosen = preemptions([pack("p-mid", {"mid"}), pack("p-big", {"big"})], [WaitingTrial("t1", "small", 1)], usage,
                         {}, POLICY)
    assert [(c.pack_id, c.for_tenant) for c in chosen] == [("p-big", "small")]
    assert "tenant small" in chosen[0].reason


def test_weights_scale_the_share() -> None:
    # "heavy" has used twice the GPU time of "light", but weighs 3: per unit of weight it is behind.
    usage, weights = {"heavy": 2000.0, "light": 1000.0}, {"heavy": 3}
    assert normalised_usage(usage, weights, "heavy") == pytest.approx(666.67, abs=0.01)
    assert preemptions([pack("p", {"light"})], [WaitingTrial("t", "heavy", 1)], usage, weights, POLICY)
    assert not preemptions([pack("p", {"heavy"})], [WaitingTrial("t", "light", 1)], usage, weights, POLICY)


@pytest.mark.parametrize(("view", "why"), [
    (pack("p", {"a"}, running_s=299), "it has not run its slice"),
    (pack("p", {"a"}, pauses=(0, 2)), "a member was paused max_pauses times"),
    (pack("p", {"a", "w"}), "the waiting tenant is in it"),
    (pack("p", {"a", "b"}), "one of its tenants is not ahead of the waiting one"),
])
def test_no_preemption_outside_the_bounds(view: PackView, why: str) -> None:
    usage = {"a": 5000.0, "b": 10.0, "w": 100.0}
    assert preemptions([view], [WaitingTrial("t", "w", 1)], usage, {}, POLICY) == [], why


def test_a_trial_needing_more_gpus_than_the_pack_has_frees_nothing() -> None:
    assert preemptions([pack("p", {"a"}, gpus=1)], [WaitingTrial("t", "w", 2)], {"a": 9e9}, {}, POLICY) == []


def test_one_pack_per_waiting_tenant_the_least_served_first() -> None:
    usage = {"a": 9000.0, "b": 8000.0, "w1": 50.0, "w2": 10.0}
    chosen = preemptions([pack("pa", {"a"}), pack("pb", {"b"})],
                         [WaitingTrial("x", "w1", 1), WaitingTrial("y", "w2", 1), WaitingTrial("z", "w2", 1)],
                         usage, {}, POLICY)
    assert [(c.pack_id, c.for_tenant) for c in chosen] == [("pa", "w2"), ("pb", "w1")]


def test_usage_counts_the_window_only_split_by_members() -> None:
    segments = [(0.0, 1000.0, 1.0, {"a": 1}),  # half of it inside [500, 2500]
                (1000.0, 3000.0, 2.0, {"a": 1, "b": 3})]  # 1500 s inside, 2 GPUs, a quarter to "a"
    usage = usage_in_window(segments, now=2500.0, window_s=2000.0)
    assert usage == {"a": pytest.approx(500 + 1500 * 2 / 4), "b": pytest.approx(1500 * 2 * 3 / 4)}


def one_gpu_trace() -> Trace:
    """One GPU: a long 8B pack of tenant "batch", then, 10 s later, a short task of a small model from "team"."""
    big, small = "llama-3.1-8b", "qwen2.5-0.5b"
    long_task = TraceTask("long", "batch", 1, big, 1, 0.0,
                          (TraceTrial("long-t0", 2048, 20_000, slot_bytes(big, 8), 8),))
    short_task = TraceTask("short", "team", 1, small, 1, 10.0,
                           (TraceTrial("short-t0", 2048, 200, slot_bytes(small, 8), 8),))
    return Trace("one-gpu", (long_task, short_task), {big: model_cost(big, 1), small: model_cost(small, 1)})


def test_the_simulator_preempts_a_long_pack_for_a_short_task_of_another_model() -> None:
    trace = one_gpu_trace()
    today = simulate(trace, 1, "greedy")
    fair = simulate(trace, 1, "greedy", fairness=POLICY, pause_cost_s=30.0)
    assert today.preempted == 0 and fair.preempted == 1
    # Today the short task waits for the whole long pack; with preemption, for one slice and the pause.
    assert today.completed_s["short-t0"] > today.completed_s["long-t0"]
    assert fair.completed_s["short-t0"] < fair.completed_s["long-t0"]
    assert fair.started_s["short-t0"] == pytest.approx(POLICY.min_slice_s + 30.0)
    # The long trial loses no work but the step it was in (it resumes at a step boundary): it ends later by the
    # short task, the pause and at most one step.
    assert fair.steps_done == today.steps_done
    short_s = fair.completed_s["short-t0"] - fair.started_s["short-t0"]
    one_step = trace.costs["llama-3.1-8b"].step.predict(2048, 1)
    delay = fair.completed_s["long-t0"] - today.completed_s["long-t0"] - short_s - 30.0
    assert 0 <= delay <= one_step
    assert fair.started_s["long-t0"] == 0.0  # its first start
