"""The early-exit policies on hand-built curves: each detector at its thresholds, the warm-up boundary,
hold/resume, ASHA's rungs, and decide() called again and again on growing curves.

Losses and thresholds are powers of two where a test sits exactly on a threshold, so float rounding
cannot decide it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from scheduler.early_exit.config import EarlyExitConfig, EarlyExitSpecError, defaults, from_spec, to_spec
from scheduler.early_exit.policy import (
    Point,
    TrialCurves,
    asha_rungs,
    curves_from_losses,
    decide,
    describe,
    evaluations,
    rung_steps,
    warmup_step,
)

TOKENS = 10  # tokens per sample in these curves


def pts(xs: Sequence[tuple[int, float]], bs: int = 1) -> tuple[Point, ...]:
    return tuple(Point(step, step * bs, step * bs * TOKENS, loss) for step, loss in xs)


def trial(tid: str, val: Sequence[tuple[int, float]], train: Sequence[tuple[int, float]] | None = None, *,
          total: int = 100, state: str = "running", bs: int = 1) -> TrialCurves:
    """Train points default to the val points (gap 0, same slopes)."""
    return TrialCurves(tid, state, total, bs, bs * TOKENS, train=pts(train if train is not None else val, bs),
                       val=pts(val, bs))


# ema_alpha = 1: the smoothed train loss is the last train loss, so the numbers are exact. One rung keeping a
# quarter: ALTO's own warm-up cut (the multi-rung default has tests of its own below).
ALTO = EarlyExitConfig(policy="alto", ema_alpha=1.0, tau_slope=0.25, tau_gap=0.5, rungs=1, keep_ratio=0.25)


def stops(decisions: Sequence) -> dict[str, str]:
    return {d.trial_id: d.reason for d in decisions if d.action == "stop"}


# ---- config and spec ------------------------------------------------------------------------------------


def test_defaults_are_altos_and_ashas() -> None:
    assert defaults("alto") == {"window": 2, "patience_div": 2, "patience_ovf": 2, "tau_slope": 0.001,
                                "tau_gap": 0.1, "warmup_ratio": 0.05, "keep_ratio": 0.45, "rungs": 2,
                                "ema_alpha": 0.05}
    assert defaults("asha") == {"reduction_factor": 4, "num_rungs": 3}
    assert defaults("none") == {}


def test_spec_round_trips_and_fills_defaults() -> None:
    config = from_spec({"policy": "alto", "window": 3, "keep_ratio": 1})
    assert (config.window, config.keep_ratio, config.tau_gap) == (3, 1.0, 0.1)
    assert isinstance(config.keep_ratio, float)
    assert from_spec(to_spec(config)) == config
    assert to_spec(from_spec({"policy": "none"})) == {"policy": "none"}
    assert from_spec({}).policy == "none"


@pytest.mark.parametrize(("spec", "param"), [
    ({"policy": "median"}, "policy"),
    ({"policy": "asha", "window": 3}, "window"),
    ({"policy": "none", "keep_ratio": 0.5}, "keep_ratio"),
    ({"policy": "alto", "window": 1}, "window"),
    ({"policy": "alto", "window": 2.0}, "window"),
    ({"policy": "alto", "keep_ratio": 0}, "keep_ratio"),
    ({"policy": "alto", "warmup_ratio": 0.6}, "warmup_ratio"),
    ({"policy": "alto", "ema_alpha": float("nan")}, "ema_alpha"),
    ({"policy": "alto", "tau_gap": True}, "tau_gap"),
    ({"policy": "asha", "reduction_factor": 1}, "reduction_factor"),
])
def test_bad_spec_names_the_parameter(spec: dict, param: str) -> None:
    with pytest.raises(EarlyExitSpecError) as err:
        from_spec(spec)
    assert err.value.param == param


def test_warmup_step_is_a_share_of_the_trials_own_steps() -> None:
    config = EarlyExitConfig(policy="alto")
    assert [warmup_step(config, n) for n in (1, 19, 20, 60, 100, 1000)] == [1, 1, 1, 3, 5, 50]
    assert warmup_step(EarlyExitConfig(warmup_ratio=0.3), 10) == 3  # not 4: 0.3 * 10 rounds above 3


def test_curves_from_stored_losses_count_samples_and_tokens_per_step() -> None:
    t = curves_from_losses("a", "running", 100, 4, 4 * 512, train=[(2, 1.5), (1, 2.0)], val=[(2, 1.75)])
    assert t.train == (Point(1, 4, 2048, 2.0), Point(2, 8, 4096, 1.5))
    assert t.val == (Point(2, 8, 4096, 1.75),)
    with pytest.raises(ValueError, match="strictly increasing"):
        curves_from_losses("a", "running", 100, 1, 1, train=[(1, 2.0), (1, 2.0)], val=[])
    with pytest.raises(ValueError, match="unknown state"):
        curves_from_losses("a", "paused", 100, 1, 1, train=[], val=[])


# ---- divergence --------------------------------------------------------------------------------------------


def test_divergence_needs_both_slopes_at_the_threshold_for_patience_evaluations() -> None:
    rising = [(10, 1.0), (20, 1.25), (30, 1.5)]  # slope exactly tau_slope = 0.25 per evaluation
    assert decide(ALTO, [trial("a", rising[:2])]) == []  # one evaluation with both slopes up: count 1
    [d] = decide(ALTO, [trial("a", rising)])
    assert (d.action, d.reason, d.step, d.export_best) == ("stop", "diverging", 30, False)
    assert (d.numbers["slope_train"], d.numbers["slope_val"], d.numbers["count"]) == (0.25, 0.25, 2)


def test_divergence_below_the_threshold_or_on_one_curve_only_does_not_trigger() -> None:
    slow = [(10, 1.0), (20, 1.125), (30, 1.25), (40, 1.375)]  # slope 0.125 < 0.25
    assert decide(ALTO, [trial("a", slow)]) == []
    val_up = [(10, 1.0), (20, 1.25), (30, 1.5), (40, 1.75)]
    train_down = [(10, 1.0), (20, 0.75), (30, 0.5), (40, 0.25)]
    wide = EarlyExitConfig(policy="alto", ema_alpha=1.0, tau_slope=0.25, tau_gap=100.0)  # no overfitting here
    assert decide(wide, [trial("a", val_up, train_down)]) == []


def test_divergence_patience_resets_when_a_slope_drops() -> None:
    # up, up (count 1), down (reset), up (count 1), up (count 2)
    val = [(10, 1.0), (20, 1.25), (30, 1.0), (40, 1.25), (50, 1.5)]
    counts = [e.div_count for e in evaluations(ALTO, trial("a", val))]
    assert counts == [0, 1, 0, 1, 2]
    assert decide(ALTO, [trial("a", val[:4])]) == []
    assert stops(decide(ALTO, [trial("a", val)])) == {"a": "diverging"}


def test_divergence_is_active_during_warm_up() -> None:
    # Trial "a" diverges long before its warm-up step (50 of 1000); "b" has not reached its boundary.
    a = trial("a", [(10, 1.0), (20, 1.25), (30, 1.5)], total=1000)
    b = trial("b", [(10, 1.0)], total=1000)
    assert stops(decide(ALTO, [a, b])) == {"a": "diverging"}


def test_a_non_finite_loss_stops_at_once() -> None:
    a = trial("a", [(10, 1.0)], [(5, 1.0), (7, math.nan), (10, 1.0)])
    [d] = decide(ALTO, [a])
    assert (d.reason, d.step, d.numbers) == ("diverging", 7, {"non_finite": True})
    assert stops(decide(EarlyExitConfig(policy="asha"), [a])) == {"a": "diverging"}
    assert decide(EarlyExitConfig(policy="none"), [a]) == []


# ---- overfitting -------------------------------------------------------------------------------------------


def test_overfitting_needs_a_gap_above_tau_for_patience_evaluations_and_exports_the_best() -> None:
    train = [(10, 1.0), (20, 1.0), (30, 1.0), (40, 1.0)]
    at_tau = [(10, 1.0), (20, 1.5), (30, 1.5), (40, 1.5)]  # gap exactly 0.5: not > tau_gap
    assert decide(ALTO, [trial("a", at_tau, train)]) == []
    above = [(10, 0.875), (20, 1.75), (30, 1.75)]  # gap 0.75 twice (val flat: no divergence)
    [d] = decide(ALTO, [trial("a", above, train[:3])])
    assert (d.action, d.reason, d.step, d.export_best) == ("stop", "overfitting", 30, True)
    assert (d.numbers["gap"], d.numbers["count"]) == (0.75, 2)
    assert (d.numbers["best_val_loss"], d.numbers["best_val_step"]) == (0.875, 10)
    assert "best adapter" in d.message


def test_overfitting_patience_resets_on_a_small_gap() -> None:
    train = [(s, 1.0) for s in (10, 20, 30, 40)]
    val = [(10, 1.75), (20, 1.25), (30, 1.75), (40, 1.25)]  # gap, no gap, gap, no gap
    assert [e.ovf_count for e in evaluations(ALTO, trial("a", val, train))] == [1, 0, 1, 0]
    assert decide(ALTO, [trial("a", val, train)]) == []


def test_ema_smooths_per_step_whatever_the_logging_interval() -> None:
    config = EarlyExitConfig(policy="alto", ema_alpha=0.5)
    every_step = trial("a", [(3, 1.0)], [(1, 2.0), (2, 1.0), (3, 1.0)])
    every_other = trial("b", [(3, 1.0)], [(1, 2.0), (3, 1.0)])
    assert evaluations(config, every_step)[0].train_ema == evaluations(config, every_other)[0].train_ema == 1.25


def test_a_val_point_before_any_train_point_is_not_an_evaluation() -> None:
    t = trial("a", [(0, 3.0), (10, 1.0)], [(1, 1.0), (10, 1.0)])
    assert [e.step for e in evaluations(ALTO, t)] == [10]


# ---- warm-up boundary ----------------------------------------------------------------------------------


def warm(n: int, losses: Sequence[float] | None = None, total: int = 100) -> list[TrialCurves]:
    """n trials with one val point at step 5 (the warm-up step of 100 steps)."""
    losses = losses if losses is not None else [1.0 + i / 8 for i in range(n)]
    return [trial(f"t{i}", [(5, loss)], total=total) for i, loss in enumerate(losses)]


@pytest.mark.parametrize(("n", "kept"), [(1, 1), (4, 1), (5, 2), (8, 2), (12, 3), (13, 4)])
def test_warm_up_boundary_keeps_the_ceiling_of_a_quarter(n: int, kept: int) -> None:
    decisions = decide(ALTO, warm(n))
    assert stops(decisions) == {f"t{i}": "underperforming" for i in range(kept, n)}
    if n > kept:
        d = next(d for d in decisions if d.trial_id == f"t{kept}")
        assert (d.numbers["rank"], d.numbers["ranked"], d.numbers["keep"]) == (kept + 1, n, kept)
        assert d.numbers["cutoff"] == 1.0 + (kept - 1) / 8


def test_warm_up_ties_go_to_the_smaller_id_whatever_the_order() -> None:
    trials = warm(5, [2.0, 1.0, 1.5, 1.5, 3.0])  # keep 2: t1, then t2 or t3 at 1.5 -> t2
    assert set(stops(decide(ALTO, trials))) == {"t0", "t3", "t4"}
    assert set(stops(decide(ALTO, trials[::-1]))) == {"t0", "t3", "t4"}


def test_warm_up_ranks_by_the_boundary_point_not_the_latest() -> None:
    # t0 was worst at its boundary (step 5) and has since improved; the ranking still uses step 5.
    trials = [trial("t0", [(5, 3.0), (10, 0.5)]), *warm(4)[1:]]
    assert "t0" in stops(decide(ALTO, trials))


def test_hold_until_every_surviving_trial_reached_its_own_boundary() -> None:
    # a: 100 steps (boundary 5); b: 400 steps (batch 1/4 of a's: boundary 20); c: not started.
    a = trial("a", [(5, 1.0), (10, 0.9)])
    b = trial("b", [(10, 2.0)], total=400)
    c = TrialCurves("c", "pending", 100, 1, TOKENS)
    [d] = decide(ALTO, [a, b, c])
    assert (d.trial_id, d.action, d.reason, d.step) == ("a", "hold", "warmup_boundary", 5)
    assert d.numbers["waiting_for"] == 2
    held = TrialCurves("a", "waiting", 100, 1, TOKENS, a.train, a.val)
    assert decide(ALTO, [held, b, c]) == []  # already held: nothing new

    # b reaches its boundary, c runs its warm-up: 3 survivors, keep 1 (a, 1.0) -> a resumes, b and c stop.
    b = trial("b", [(10, 2.0), (20, 1.5)], total=400)
    c = trial("c", [(5, 1.25)])
    decisions = {d.trial_id: (d.action, d.reason) for d in decide(ALTO, [held, b, c])}
    assert decisions == {"a": ("resume", "warmup_kept"), "b": ("stop", "underperforming"),
                         "c": ("stop", "underperforming")}


def test_trials_that_cannot_reach_the_boundary_do_not_block_it() -> None:
    a, b = warm(2, [1.0, 2.0])  # t0, t1
    failed = TrialCurves("f", "failed", 100, 1, TOKENS, pts([(2, 1.0)]), ())
    diverged = trial("d", [(1, 1.0), (2, 1.25), (3, 1.5)])  # diverges at step 3, before its boundary
    decisions = decide(ALTO, [a, b, failed, diverged])
    assert stops(decisions) == {"t1": "underperforming", "d": "diverging"}  # 2 ranked -> keep 1


def test_a_trial_that_diverges_at_its_boundary_is_not_ranked() -> None:
    # t1..t4 are ranked: keep 1. Were d ranked too, 5 would be, and 2 kept.
    trials = [trial("d", [(3, 1.0), (4, 1.25), (5, 1.5)]), *warm(5)[1:]]
    assert stops(decide(ALTO, trials)) == {"d": "diverging", "t2": "underperforming", "t3": "underperforming",
                                           "t4": "underperforming"}


# ---- repeated calls ------------------------------------------------------------------------------------


def test_decide_is_repeatable_and_never_cuts_the_survivors_again() -> None:
    trials = warm(8)
    first = decide(ALTO, trials)
    assert decide(ALTO, trials) == first
    cut = set(stops(first))
    # The service stops them; the kept ones train on and report more points (still improving).
    later = [
        TrialCurves(t.trial_id, "stopped_early", t.total_steps, 1, TOKENS, t.train, t.val) if t.trial_id in cut
        else trial(t.trial_id, [(5, t.val[0].loss), (10, t.val[0].loss - 0.25), (15, t.val[0].loss - 0.5)])
        for t in trials
    ]
    assert decide(ALTO, later) == []


def test_stopped_and_finished_trials_are_never_decided() -> None:
    rising = [(10, 1.0), (20, 1.25), (30, 1.5)]
    for state in ("stopped_early", "completed", "failed", "cancelled"):
        assert decide(ALTO, [trial("a", rising, state=state)]) == []


def test_none_decides_nothing() -> None:
    assert decide(EarlyExitConfig(policy="none"), warm(8) + [trial("a", [(10, 1.0), (20, 1.25), (30, 1.5)])]) == []


# ---- asha ---------------------------------------------------------------------------------------------------

ASHA = EarlyExitConfig(policy="asha")  # eta 4, 3 rungs


def asha_trial(tid: str, val: Sequence[tuple[int, float]], *, total: int = 640, bs: int = 1,
               state: str = "running") -> TrialCurves:
    return trial(tid, val, total=total, bs=bs, state=state)


def test_rungs_are_fractions_of_the_tasks_token_budget() -> None:
    trials = [asha_trial("a", [], total=640), asha_trial("b", [], total=160, bs=2)]  # budgets 6400, 3200
    assert asha_rungs(ASHA, trials) == (100, 400, 1600)  # 6400 / 64, / 16, / 4
    assert asha_rungs(EarlyExitConfig(policy="asha", reduction_factor=2, num_rungs=2), trials) == (1600, 3200)


def test_asha_grace_then_keeps_the_best_quarter_at_a_rung() -> None:
    # Rung 1 is 100 tokens = step 10 at batch 1. Before it, nothing is stopped.
    early = [asha_trial(f"t{i}", [(5, 1.0 + i)]) for i in range(5)]
    assert decide(ASHA, early) == []
    at_rung = [asha_trial(f"t{i}", [(10, 1.0 + i)]) for i in range(5)]  # 5 at rung 1: keep 2
    decisions = decide(ASHA, at_rung)
    assert stops(decisions) == {"t2": "asha", "t3": "asha", "t4": "asha"}
    d = decisions[0]
    assert (d.numbers["rung"], d.numbers["rung_tokens"], d.numbers["rank"], d.numbers["keep"]) == (1, 100, 3, 2)
    assert d.numbers["cutoff"] == 2.0


def test_asha_is_asynchronous_first_arrivals_continue_until_better_ones_arrive() -> None:
    a = asha_trial("a", [(10, 2.0)])
    assert decide(ASHA, [a, asha_trial("b", []), asha_trial("c", [])]) == []  # alone at rung 1: kept
    b, c = asha_trial("b", [(10, 1.0)]), asha_trial("c", [(10, 1.5)])  # 3 at rung 1: keep 1
    assert stops(decide(ASHA, [a, b, c])) == {"a": "asha", "c": "asha"}


def test_asha_judges_a_trial_at_its_highest_rung_only() -> None:
    # a passed rung 1 early and is alone at rung 2 (400 tokens = step 40): kept, even though at rung 1 it is
    # now behind b and c.
    a = asha_trial("a", [(10, 2.0), (40, 1.75)])
    b, c = asha_trial("b", [(10, 1.0)]), asha_trial("c", [(10, 1.5)])
    assert stops(decide(ASHA, [a, b, c])) == {"c": "asha"}


def test_asha_compares_trials_at_the_same_tokens_whatever_their_batch() -> None:
    # b's batch is 4x a's: it reaches rung 1 (100 tokens) at step 3 (120 tokens), a at step 10.
    a = asha_trial("a", [(5, 1.0), (10, 1.0)], total=640)
    b = asha_trial("b", [(3, 2.0)], total=160, bs=4)
    assert stops(decide(ASHA, [a, b])) == {"b": "asha"}  # 2 at rung 1: keep 1
    assert decide(ASHA, [a, b]) == decide(ASHA, [a, b])


def test_asha_counts_stopped_trials_records_at_their_rung() -> None:
    done = [asha_trial(f"s{i}", [(10, 0.5)], state="stopped_early") for i in range(3)]
    late = asha_trial("late", [(10, 1.0)])  # 4 at rung 1: keep 1, and the three earlier ones are better
    assert stops(decide(ASHA, [*done, late])) == {"late": "asha"}


# ---- warm-up rungs (the default: two, keeping 45% at each) ---------------------------------------------

RUNGS = EarlyExitConfig(policy="alto", ema_alpha=1.0, tau_slope=0.25, tau_gap=0.5)  # rungs 2, keep 0.45


def test_rungs_double_from_the_warm_up_step_within_the_trials_own_steps() -> None:
    assert rung_steps(RUNGS, 100) == (5, 10)
    assert rung_steps(RUNGS, 500) == (25, 50)
    assert rung_steps(EarlyExitConfig(policy="alto", rungs=4, warmup_ratio=0.2), 10) == (2, 4, 8, 10)  # capped
    assert rung_steps(RUNGS, 1) == (1, 1)


def test_a_second_rung_ranks_the_survivors_of_the_first_again() -> None:
    # Rung 1 (step 5): 8 trials, keep ceil(0.45 x 8) = 4 (t0..t3). Rung 2 (step 10): those 4, keep 2.
    trials = [trial(f"t{i}", [(5, 1.0 + i / 8), (10, 0.9 + i / 8 - (0.3 if i == 3 else 0))]) for i in range(8)]
    decisions = decide(RUNGS, trials)
    assert stops(decisions) == {f"t{i}": "underperforming" for i in (1, 2, 4, 5, 6, 7)}  # t3 overtook t1, t2
    second = next(d for d in decisions if d.trial_id == "t1")
    assert (second.step, second.numbers["rung"], second.numbers["rungs"], second.numbers["ranked"],
            second.numbers["keep"]) == (10, 2, 2, 4, 2)
    assert "rung 2 of 2" in second.message
    first = next(d for d in decisions if d.trial_id == "t4")
    assert (first.step, first.numbers["rung"], first.numbers["ranked"], first.numbers["keep"]) == (5, 1, 8, 4)


def test_a_trial_kept_at_the_first_rung_resumes_to_reach_the_second_while_the_others_are_held() -> None:
    # a reached both rungs early; b (four times a's steps) has its first rung point only, held there earlier.
    a = trial("a", [(5, 1.0), (10, 0.8)])
    b_held = TrialCurves("b", "waiting", 400, 1, TOKENS, pts([(20, 1.2)]), pts([(20, 1.2)]))
    c = trial("c", [(5, 2.0)])
    decisions = {d.trial_id: (d.action, d.reason, d.numbers["rung"]) for d in decide(RUNGS, [a, b_held, c])}
    # Rung 1: 3 ranked, keep 2 (a, b); c stops. Rung 2: b has no point yet: it resumes, a is held at its rung 2.
    assert decisions == {"c": ("stop", "underperforming", 1), "b": ("resume", "warmup_kept", 1),
                         "a": ("hold", "warmup_boundary", 2)}
    # b trains to its rung 2 (step 40) and is worse than a there: keep ceil(0.45 x 2) = 1 -> b stops, a resumes.
    a_held = TrialCurves("a", "waiting", 100, 1, TOKENS, a.train, a.val)
    b = trial("b", [(20, 1.2), (40, 1.1)], total=400)
    c_stopped = TrialCurves("c", "stopped_early", 100, 1, TOKENS, c.train, c.val)
    decisions = {d.trial_id: (d.action, d.reason, d.numbers["rung"]) for d in decide(RUNGS, [a_held, b, c_stopped])}
    assert decisions == {"b": ("stop", "underperforming", 2), "a": ("resume", "warmup_kept", 2)}


# ---- ranking by the task's metric (issue 33) ------------------------------------------------------------------


def scored(t: TrialCurves, scores: Sequence[tuple[int, float]]) -> TrialCurves:
    """``t`` with the generative metric's scores the worker reported at these steps."""
    return TrialCurves(t.trial_id, t.state, t.total_steps, t.samples_per_step, t.tokens_per_step, t.train, t.val,
                       pts(scores, t.samples_per_step))


def test_a_warm_up_rung_ranks_by_the_metric_when_the_task_has_one() -> None:
    """The loss ranks t0 first and t3 last; the metric the user measures, the other way round. By metric the
    rung keeps the best score (ties by val loss), and the stop says what it was ranked by."""
    losses, metric = [1.0, 1.1, 1.2, 1.3, 1.4], [0.2, 0.3, 0.4, 0.9, 0.4]
    trials = [scored(t, [(5, m)]) for t, m in zip(warm(5, losses), metric, strict=True)]  # keep 2
    assert set(stops(decide(ALTO, trials))) == {"t2", "t3", "t4"}  # by loss, as before
    by_metric = decide(ALTO, trials, by_metric=True)
    assert set(stops(by_metric)) == {"t0", "t1", "t4"}  # kept: t3 (0.9), then t2 over t4 (both 0.4) by loss
    t4 = next(d for d in by_metric if d.trial_id == "t4")
    assert (t4.numbers["ranked_by"], t4.numbers["metric_score"], t4.numbers["cutoff"]) == ("metric", 0.4, 0.4)
    assert "metric score 0.4" in describe(t4) and "rung 1 of 1" in describe(t4)


def test_a_rung_without_every_trials_score_ranks_by_loss() -> None:
    """A trial with no score at its rung point (its scoring failed, an older worker): the rung falls back to the
    loss for every trial, never compares a score with a missing one."""
    trials = [scored(t, [(5, m)]) for t, m in zip(warm(4), [0.1, 0.2, 0.3, 0.9], strict=True)]
    trials[1] = warm(4)[1]  # no score
    decisions = decide(ALTO, trials, by_metric=True)
    assert set(stops(decisions)) == {"t1", "t2", "t3"}
    assert all(d.numbers["ranked_by"] == "val_loss" for d in decisions if d.action == "stop")


def test_asha_ranks_a_rung_by_the_metric_too() -> None:
    at_rung = [scored(asha_trial(f"t{i}", [(10, 1.0 + i)]), [(10, i / 10)]) for i in range(5)]  # keep 2
    assert set(stops(decide(ASHA, at_rung))) == {"t2", "t3", "t4"}
    assert set(stops(decide(ASHA, at_rung, by_metric=True))) == {"t0", "t1", "t2"}
