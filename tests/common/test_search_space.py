"""The pure search-space expansion (no server)."""

from __future__ import annotations

import pytest

from common.search_space import (
    Range,
    SearchSpaceError,
    auto_space,
    default_learning_rate,
    expand_grid,
    grid_size,
    range_points,
    sample_random,
    warmup_steps_for,
    with_size_defaults,
)


def test_grid_is_the_cartesian_product_in_dimension_order() -> None:
    configs = expand_grid({"batch_size": [2, 4], "learning_rate": [1e-4, 1e-3]})
    assert [(c["learning_rate"], c["batch_size"]) for c in configs] == [
        (1e-4, 2), (1e-4, 4), (1e-3, 2), (1e-3, 4)]
    assert list(configs[0]) == ["learning_rate", "lora_rank", "lora_alpha", "batch_size", "lora_dropout",
                                "target_modules"]


def test_empty_space_is_one_trial_of_defaults() -> None:
    assert expand_grid({}) == [{"learning_rate": 2e-4, "lora_rank": 8, "lora_alpha": 16.0, "batch_size": 4,
                                "lora_dropout": 0.0, "target_modules": "all-linear"}]


def test_alpha_defaults_to_twice_each_rank_unless_given() -> None:
    assert [c["lora_alpha"] for c in expand_grid({"lora_rank": [4, 32]})] == [8.0, 64.0]
    assert [c["lora_alpha"] for c in expand_grid({"lora_rank": [4, 32], "lora_alpha": [1.0]})] == [1.0, 1.0]


def test_duplicate_values_are_dropped() -> None:
    assert grid_size({"lora_rank": [8, 8, 16]}) == 2


@pytest.mark.parametrize(
    ("r", "integer", "expected"),
    [
        (Range(0.0, 0.2, 3), False, [0.0, 0.1, 0.2]),
        (Range(1e-5, 1e-3, 3, "log"), False, [1e-5, 1e-4, 1e-3]),
        (Range(4, 64, 5, "log"), True, [4, 8, 16, 32, 64]),
        (Range(1, 2, 5), True, [1, 2]),  # rounded, then deduplicated
        (Range(3e-4, 1e-3, 1), False, [3e-4]),
    ],
)
def test_range_points(r: Range, integer: bool, expected: list) -> None:
    assert range_points(r, integer=integer) == expected


def test_grid_range_without_num_is_an_error() -> None:
    with pytest.raises(SearchSpaceError) as info:
        grid_size({"learning_rate": Range(1e-5, 1e-3)})
    assert info.value.param == "learning_rate.num"


def test_empty_list_is_an_error() -> None:
    with pytest.raises(SearchSpaceError) as info:
        expand_grid({"lora_rank": []})
    assert info.value.param == "lora_rank"


def test_random_is_seeded_distinct_and_in_bounds() -> None:
    space = {"learning_rate": Range(1e-5, 1e-2, scale="log"), "lora_rank": Range(2, 128, scale="log"),
             "lora_dropout": Range(0.0, 0.3, num=4)}
    a, b = sample_random(space, 20, seed=1), sample_random(space, 20, seed=1)
    assert a == b and a != sample_random(space, 20, seed=2)
    assert len({str(c) for c in a}) == 20
    for c in a:
        assert 1e-5 <= c["learning_rate"] <= 1e-2
        assert isinstance(c["lora_rank"], int) and 2 <= c["lora_rank"] <= 128
        assert c["lora_dropout"] in (0.0, 0.1, 0.2, 0.3)
        assert c["lora_alpha"] == 2 * c["lora_rank"]


def test_random_from_a_small_space_gives_fewer_trials() -> None:
    assert len(sample_random({"lora_rank": [8, 16], "batch_size": [1, 2]}, 10, seed=0)) == 4


@pytest.mark.parametrize(("parameters", "rows", "rates", "ranks"), [
    (134_515_008, 2_000, [3e-4, 1e-3, 3e-3], [4, 16]),  # SmolLM2-135M on the sweeps' 2,000 rows
    (999_999_999, 9_999, [3e-4, 1e-3, 3e-3], [4, 16]),
    (1_000_000_000, 10_000, [6e-5, 2e-4, 6e-4], [8, 32]),  # 1B: QLoRA's 7B/13B centre; 10k rows: the next ranks
    (8_030_261_248, 99_999, [6e-5, 2e-4, 6e-4], [8, 32]),
    (70_553_706_496, 100_000, [3e-5, 1e-4, 3e-4], [16, 64]),
    (None, 500, [6e-5, 2e-4, 6e-4], [4, 16]),  # a model of unknown size: the middle centre
])
def test_the_auto_space_follows_the_models_and_the_datasets_size(
    parameters: int | None, rows: int, rates: list[float], ranks: list[int]
) -> None:
    space = auto_space(parameters, rows)
    assert space == {"learning_rate": rates, "lora_rank": ranks}
    configs = expand_grid(space)  # six trials; every other dimension at its default
    assert len(configs) == 6 and {c["target_modules"] for c in configs} == {"all-linear"}
    assert [c["lora_alpha"] for c in configs] == [2.0 * c["lora_rank"] for c in configs]


def test_warmup_is_three_percent_of_a_trials_own_steps_unless_given() -> None:
    assert [warmup_steps_for(n, None) for n in (1, 2, 33, 34, 100, 125, 500)] == [0, 1, 1, 2, 3, 4, 15]
    assert warmup_steps_for(500, 0) == 0 and warmup_steps_for(500, 40) == 40


@pytest.mark.parametrize(("parameters", "rate"), [
    (134_515_008, 1e-3), (999_999_999, 1e-3), (1_000_000_000, 2e-4), (70_553_706_496, 1e-4), (None, 2e-4)])
def test_a_learning_rate_left_out_is_the_auto_centre_for_the_models_size(parameters: int | None, rate: float) -> None:
    assert default_learning_rate(parameters) == rate
    assert auto_space(parameters, 500)["learning_rate"][1] == rate  # one rule for both
    [config] = expand_grid(with_size_defaults({"lora_rank": [8]}, parameters))
    assert config["learning_rate"] == rate
    # A learning rate the user gave is kept, whatever the size.
    assert with_size_defaults({"learning_rate": [5e-5]}, parameters)["learning_rate"] == [5e-5]
