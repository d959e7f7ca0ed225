"""The pure estimate (scheduler/planning/estimate.py): tokens, GPU seconds and wall seconds of a task's trials."""

from __future__ import annotations

import pytest

from scheduler.planning.cost import (
    CPU_DEVICE_KIND,
    GPU_DEVICE_KIND,
    PRIOR_COST,
    MemoryModel,
    ModelCost,
    StepTimeModel,
    device_kind,
    prior_cost,
)
from scheduler.planning.estimate import FITTED_BAND, PRIOR_BAND, Basis, Estimate, TrialLoad, UsableWorker, estimate

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


def test_the_basis_names_the_priors_or_the_packs_of_a_fit_and_its_device_kind() -> None:
    assert run().basis == Basis("prior", GPU_DEVICE_KIND, 0)
    fitted = estimate([TrialLoad(100, 2048)] * 8, ModelCost(FITTED.memory, FITTED.step, packs=3), [UsableWorker()],
                      max_trials_per_pack=32, on_priors=False, kind=CPU_DEVICE_KIND)
    assert fitted.basis == Basis("fitted", CPU_DEVICE_KIND, 3)
    assert fitted.as_dict()["basis"] == {"source": "fitted", "device_kind": "cpu", "packs": 3}


@pytest.mark.parametrize("kind", [GPU_DEVICE_KIND, CPU_DEVICE_KIND])
def test_the_band_is_ordered_and_wider_on_the_priors_than_fitted(kind: str) -> None:
    prior = estimate([TrialLoad(100, 2048)] * 8, prior_cost(135_000_000, kind), [UsableWorker()],
                     max_trials_per_pack=32, on_priors=True, kind=kind)
    fitted = estimate([TrialLoad(100, 2048)] * 8, FITTED, [UsableWorker()], max_trials_per_pack=32, on_priors=False,
                      kind=kind)
    for e in (prior, fitted):
        assert e.wall_band is not None and e.wall_seconds is not None
        low, high = e.wall_band
        assert 0 < low < e.wall_seconds < high
        assert e.as_dict()["wall_seconds_low"] == low and e.as_dict()["wall_seconds_high"] == high
    assert prior.wall_band == pytest.approx((prior.wall_seconds * PRIOR_BAND[kind][0],  # type: ignore[operator]
                                             prior.wall_seconds * PRIOR_BAND[kind][1]), abs=1e-3)  # type: ignore[operator]
    assert fitted.wall_band == pytest.approx((fitted.wall_seconds * FITTED_BAND[0],  # type: ignore[operator]
                                              fitted.wall_seconds * FITTED_BAND[1]), abs=1e-3)  # type: ignore[operator]
    assert PRIOR_BAND[kind][1] / PRIOR_BAND[kind][0] > FITTED_BAND[1] / FITTED_BAND[0]


def test_without_a_wall_time_there_is_no_band() -> None:
    e = run(gpus=[])
    assert e.wall_band is None
    assert e.as_dict()["wall_seconds_low"] is None and e.as_dict()["wall_seconds_high"] is None


def test_the_cpu_priors_are_slower_and_grow_with_the_model_while_the_gpu_priors_stay() -> None:
    """The GPU priors are what the daemon has always planned with (one for every size); the CPU's step grows with
    the model's parameters (benchmarks/results/cpu_priors-cpu-20261126.json)."""
    assert prior_cost(None) == PRIOR_COST and prior_cost(None, GPU_DEVICE_KIND) == PRIOR_COST
    assert prior_cost(135_000_000).step == PRIOR_COST.step == prior_cost(7_000_000_000).step
    tiny, smol = prior_cost(107_200, CPU_DEVICE_KIND), prior_cost(134_515_008, CPU_DEVICE_KIND)
    assert tiny.prior and smol.prior and smol.memory == prior_cost(134_515_008).memory
    # SmolLM2 at 4 trials x batch 4 x 128 tokens: ~50x the H100's step on the CPU, the tiny model far less.
    assert smol.step.predict(2048, 4) > 20 * PRIOR_COST.step.predict(2048, 4)
    assert tiny.step.predict(2048, 4) < smol.step.predict(2048, 4) / 50
    assert prior_cost(None, CPU_DEVICE_KIND).step == smol.step  # an unknown size: priced as SmolLM2


def test_a_workers_device_kind_is_the_cpu_or_a_gpu() -> None:
    assert device_kind("cpu") == device_kind("cpu,cpu") == CPU_DEVICE_KIND
    assert device_kind("cuda:0") == device_kind("cuda:0,cuda:1") == device_kind(None) == GPU_DEVICE_KIND
