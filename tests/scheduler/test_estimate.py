"""The pure estimate (scheduler/planning/estimate.py): tokens, GPU seconds and wall seconds of a task's trials."""

from __future__ import annotations

import pytest

from scheduler.planning.cost import PRIOR_COST, MemoryModel, ModelCost, StepTimeModel
from scheduler.planning.estimate import Estimate, TrialLoad, UsableWorker, estimate

# A GPU-bound model (small shared cost): trials spread over GPUs rather than share one.
FITTED = ModelCost(memory=MemoryModel(k0_bytes=2 * 2**30, k1_bytes_per_token=2**20),
                   step=StepTimeModel(a_s=0.01, b_s_per_token=1e-4, c_s_per_slot=1e-3))


def run(steps: int = 100, trials: int = 8, tokens: int = 2048, gpus: list[UsableWorker] | None = None,
        cost: ModelCost = PRIOR_COST) -> Estimate:
    return estimate([TrialLoad(steps, tokens)] * trials, cost, [UsableWorker()] if gpus is None else gpus,
                    max_trials_per_pack=32, on_priors=cost is PRIOR_COST)


@pytest.mark.parametrize("cost", [PRIOR_COST, FITTED])
def test_more_steps_cost_more(cost: ModelCost) -> None:
    estimates = [run(steps=s, cost=cost) for s in (10, 50, 100, 400)]
    assert [e.tokens for e in estimates] == [s * 8 * 2048 for s in (10, 50, 100, 400)]
    for shorter, longer in zip(estimates, estimates[1:], strict=False):
        assert shorter.gpu_seconds < longer.gpu_seconds
        assert shorter.wall_seconds is not None and longer.wall_seconds is not None
        assert shorter.wall_seconds < longer.wall_seconds


@pytest.mark.parametrize("cost", [PRIOR_COST, FITTED])
def test_more_gpus_finish_sooner(cost: ModelCost) -> None:
    walls = [run(gpus=[UsableWorker()] * n, cost=cost).wall_seconds for n in (1, 2, 4, 8)]
    assert all(w is not None for w in walls)
    assert walls == sorted(walls, reverse=True) and walls[0] > walls[-1], walls  # type: ignore[type-var]


def test_one_gpu_runs_one_pack_of_everything_on_the_priors() -> None:
    # 8 trials in one pack (fill_now): a step of 0.25 s shared + 8 x (2048 x 1.3e-5 + 1e-3) s, 100 steps.
    e = run()
    step = 0.25 + 8 * (2048 * 1.3e-5 + 1e-3)
    assert e.gpu_seconds == pytest.approx(100 * step, abs=0.2)
    assert e.wall_seconds == e.gpu_seconds  # one GPU, free now


def test_a_busy_cluster_finishes_later_by_the_wait() -> None:
    free = run()
    busy = run(gpus=[UsableWorker(busy_for_s=120.0)])
    assert free.wall_seconds is not None and busy.wall_seconds is not None
    assert busy.wall_seconds == pytest.approx(free.wall_seconds + 120.0, abs=0.2)
    assert busy.gpu_seconds == free.gpu_seconds  # the same work, only later
    # Two GPUs, one busy for long: the free one takes the work now.
    assert run(gpus=[UsableWorker(), UsableWorker(busy_for_s=10_000.0)]).wall_seconds == free.wall_seconds


def test_a_fitted_model_differs_from_the_priors() -> None:
    prior, fitted = run(), run(cost=FITTED)
    assert prior.tokens == fitted.tokens
    # Fitted: between one pack of all 8 (100 steps of 0.01 + 8 x (0.2048 + 0.001) s) and the 8 one after another
    # (100 steps of 0.01 + 0.2048 + 0.001 s each); the priors' one pack is 100 steps of 0.25 + 8 x 0.0276 s.
    item = 2048 * 1e-4 + 1e-3
    assert 100 * (0.01 + 8 * item) - 0.1 <= fitted.gpu_seconds <= 8 * 100 * (0.01 + item) + 0.5
    assert fitted.gpu_seconds != pytest.approx(prior.gpu_seconds, rel=0.05)


def test_without_a_usable_gpu_there_is_no_wall_time() -> None:
    e = run(gpus=[])
    assert e.wall_seconds is None and e.gpu_seconds == run().gpu_seconds  # priced on one default GPU
    # A trial no GPU can hold (memory): no wall time either, its GPU time priced alone.
    small = run(gpus=[UsableWorker(memory_bytes=2**30)], trials=1, tokens=4096)  # 4096 tokens x 2 MiB = 8 GiB > 1 GiB
    assert small.wall_seconds is None
    assert small.gpu_seconds == pytest.approx(100 * (0.25 + 4096 * 1.3e-5 + 1e-3), abs=1e-3)


def test_no_trials_cost_nothing() -> None:
    assert estimate([], PRIOR_COST, [UsableWorker()], max_trials_per_pack=32, on_priors=True) == Estimate(0, 0.0, 0.0)
