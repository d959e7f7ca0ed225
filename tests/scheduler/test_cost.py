"""The cost model: fitting pack profiles, predictions, online correction, rounding."""

from __future__ import annotations

import random

import pytest

from scheduler.planning.cost import (
    BYTES_PER_ADAPTER_PARAM,
    PRIOR_COST,
    MemoryModel,
    ProfileSample,
    StepTimeModel,
    adapter_params,
    corrected,
    fit_profiles,
    prior_cost,
    samples_from_profiles,
    trial_duration_s,
)


def synthetic(n: int, *, k0: float = 2e9, k1: float = 3e5, a: float = 0.05, b: float = 2e-5, c: float = 4e-3,
              noise: float = 0.0, seed: int = 0) -> list[ProfileSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        slots, tokens, padded = rng.randint(1, 8), rng.randint(100, 8000), rng.randint(0, 500)
        total = tokens + padded
        secs = (a + b * total + c * slots) * (1 + rng.uniform(-noise, noise))
        out.append(ProfileSample(slots, tokens, padded, secs, int(k0 + k1 * total)))
    return out


def test_fit_recovers_known_coefficients() -> None:
    memory, step = fit_profiles(synthetic(60))
    assert memory.k0_bytes == pytest.approx(2e9, rel=1e-3)
    assert memory.k1_bytes_per_token == pytest.approx(3e5, rel=1e-3)
    assert (step.a_s, step.b_s_per_token, step.c_s_per_slot) == pytest.approx((0.05, 2e-5, 4e-3), rel=1e-6)


def test_fit_with_noise_stays_close() -> None:
    _, step = fit_profiles(synthetic(200, noise=0.02, seed=3))
    assert step.predict(4000, 4) == pytest.approx(0.05 + 2e-5 * 4000 + 4e-3 * 4, rel=0.03)


def test_fit_never_gives_negative_coefficients() -> None:
    # Step time that falls with slots would fit c < 0: the fit drops it to 0 instead.
    samples = [ProfileSample(s, t, 0, 0.1 + 1e-5 * t - 0.01 * s, 10**9 + 10 * t)
               for s, t in [(1, 1000), (2, 3000), (4, 2000), (8, 7000), (3, 500)]]
    memory, step = fit_profiles(samples)
    assert min(memory.k0_bytes, memory.k1_bytes_per_token, step.a_s, step.b_s_per_token, step.c_s_per_slot) >= 0


def test_single_sample_falls_back_to_priors_and_reproduces_the_sample() -> None:
    (sample,) = synthetic(1, seed=5)
    memory, step = fit_profiles([sample])
    tokens = sample.tokens + sample.padded_tokens
    assert step.predict(tokens, sample.active_slots) == pytest.approx(sample.seconds)
    assert memory.predict(tokens, 0) >= sample.peak_memory_bytes  # type: ignore[operator]
    assert min(step.a_s, step.b_s_per_token, step.c_s_per_slot, memory.k0_bytes) >= 0
    assert step.b_s_per_token > 0 and memory.k1_bytes_per_token > 0  # more tokens still cost more


def test_single_fast_sample_scales_the_priors_down() -> None:
    memory, step = fit_profiles([ProfileSample(8, 50_000, 0, 0.01, None)])
    assert step.predict(50_000, 8) == pytest.approx(0.01)
    assert min(step.a_s, step.b_s_per_token, step.c_s_per_slot) >= 0
    assert memory.k1_bytes_per_token > 0  # no memory measured: the prior


def test_fit_needs_a_sample() -> None:
    with pytest.raises(ValueError):
        fit_profiles([])


def test_samples_from_profiles_reads_the_worker_format() -> None:
    profile = {"device": "cuda", "steps": 2, "samples": [[2, 1000, 24, 0.5, 123], [3, 900, 0, 0.4, None]]}
    assert samples_from_profiles([profile, {"samples": []}]) == [
        ProfileSample(2, 1000, 24, 0.5, 123), ProfileSample(3, 900, 0, 0.4, None)]


def test_predictions_are_monotone() -> None:
    memory, step = fit_profiles(synthetic(40, noise=0.05, seed=1))
    for tokens in range(0, 20_000, 1000):
        assert memory.predict(tokens + 1000, 0) >= memory.predict(tokens, 0)
        assert memory.predict(tokens, 1000) >= memory.predict(tokens, 0)
        for slots in range(1, 8):
            assert step.predict(tokens + 1000, slots) >= step.predict(tokens, slots)
            assert step.predict(tokens, slots + 1) >= step.predict(tokens, slots)


def test_memory_counts_sixteen_bytes_per_adapter_parameter() -> None:
    m = MemoryModel(1000.0, 2.0)
    assert m.predict(10, 5) == 1000 + 20 + 5 * BYTES_PER_ADAPTER_PARAM == 1100


def test_adapter_params() -> None:
    # Two modules of 4096→4096 and one 4096→11008 at rank 8.
    assert adapter_params([(4096, 4096), (4096, 4096), (4096, 11008)], 8) == 8 * (8192 * 2 + 15104)
    assert adapter_params([], 16) == 0
    with pytest.raises(ValueError):
        adapter_params([(1, 1)], -1)


def test_correction_smooths_the_measured_ratio() -> None:
    assert corrected(1.0, 2.0, 0.0) == 2.0
    assert corrected(1.0, 2.0, 1.0) == 1.0
    ratio = 1.0
    for _ in range(50):
        ratio = corrected(1.0, 1.5, 0.8, ratio)
    assert ratio == pytest.approx(1.5, rel=1e-3)
    assert corrected(0.0, 1.0, 0.5, 1.2) == 1.2  # nothing to learn from a zero prediction
    with pytest.raises(ValueError):
        corrected(1.0, 1.0, 1.5)


def test_trial_duration_rounds_up_and_is_never_zero() -> None:
    assert trial_duration_s(0, 1.0) == 0.0
    assert trial_duration_s(1, 1e-9) == 0.001
    assert trial_duration_s(3, 0.1) == pytest.approx(0.3)
    assert trial_duration_s(7, 0.0001234) >= 7 * 0.0001234
    assert StepTimeModel(0.0, 0.0, 0.0).predict(100, 1) == 0.0


def test_the_prior_of_a_model_of_unknown_size_is_the_bare_prior() -> None:
    assert prior_cost(None) is PRIOR_COST
    assert PRIOR_COST.prior and PRIOR_COST.memory.k0_bytes == 0


def test_the_prior_of_a_model_of_known_size_holds_its_frozen_bf16_weights() -> None:
    cost = prior_cost(70_000_000_000)
    assert cost.memory.k0_bytes == 140e9  # Llama-3.1-70B: 2 bytes per parameter
    assert cost.memory.k1_bytes_per_token == PRIOR_COST.memory.k1_bytes_per_token
    assert cost.step == PRIOR_COST.step and cost.prior  # nothing measured: the step time is the prior's
    assert cost.memory.predict(1000, 0) == PRIOR_COST.memory.predict(1000, 0) + 140_000_000_000


def test_the_prior_of_a_base_held_in_nf4_holds_its_4_bit_weights() -> None:
    cost = prior_cost(70_000_000_000, quantization="nf4")
    assert cost.memory.k0_bytes == 42e9  # 0.6 bytes a parameter: a 70B base fits one 80 GB GPU
    assert cost.memory.k0_bytes < 80 * 2**30 < prior_cost(70_000_000_000).memory.k0_bytes
