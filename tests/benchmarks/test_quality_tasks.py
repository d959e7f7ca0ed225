"""The quality benchmark's tasks and scorers (benchmarks/quality/): fixed, disjoint splits; metrics that give the
reference full marks, a wrong answer none, and a near answer partial credit; intervals over seeds."""

from __future__ import annotations

import json

import pytest

from benchmarks.quality.scoring import chrf, exact, json_fields
from benchmarks.quality.stats import mean_ci, paired_diff_ci
from benchmarks.quality.tasks import SIZES, TASKS, TEST_ROWS, VAL_ROWS, score_rows, splits


def prompts(rows: list[dict]) -> list[str]:
    return [r["messages"][0]["content"] for r in rows]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_task_has_fixed_disjoint_splits_and_its_references_score_full(task: str) -> None:
    small, large = splits(task, "small"), splits(task, "large")
    assert [len(small[s]) for s in ("train", "val", "test")] == [SIZES["small"], VAL_ROWS, TEST_ROWS]
    assert len(large["train"]) == SIZES["large"]
    assert small == splits(task, "small")  # drawn from the seed: the same every time
    assert prompts(small["train"]) == prompts(large["train"])[: SIZES["small"]]
    assert small["val"] == large["val"] and small["test"] == large["test"]
    train, val, test = (set(prompts(large[s])) for s in ("train", "val", "test"))
    assert not (train & val or train & test or val & test)
    assert splits(task, "small", seed=1)["test"] != small["test"]
    references = [r["reference"] for r in small["test"]]
    assert score_rows(task, references, small["test"]) == 1.0
    assert score_rows(task, ["no idea"] * len(references), small["test"]) < 0.2


def test_unknown_task_or_size_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        splits("poetry")
    with pytest.raises(ValueError, match="unknown size"):
        splits("topics", "huge")


def test_exact_match_ignores_case_space_and_surrounding_punctuation() -> None:
    assert exact(" Lyon.", "lyon") == 1.0
    assert exact("Lyon, France", "Lyon") == 0.0


def test_json_fields_gives_credit_per_field_and_none_without_json() -> None:
    reference = json.dumps({"name": "Ada", "age": 34, "city": "Lyon", "job": "baker"})
    assert json_fields('Sure: {"name": "Ada", "age": "34", "city": "Lyon", "job": "baker"}', reference) == 1.0
    assert json_fields('{"name": "Ada", "age": 35, "city": "lyon"}', reference) == 0.5
    assert json_fields("name: Ada, age: 34", reference) == 0.0
    assert json_fields('{"name": "Ada", "age": 3', reference) == 0.0


def test_chrf_matches_its_definition() -> None:
    assert chrf("river lamp", "river lamp") == 1.0
    assert chrf("xyz", "abc") == 0.0
    # "ab" against "abc": orders 1 (P 1, R 2/3) and 2 (P 1, R 1/2); P = 1, R = 7/12; F2 = 5PR / (4P + R) = 35/55.
    assert chrf("ab", "abc") == pytest.approx(35 / 55)
    assert chrf("river lamp", "lamp river") > chrf("cloud stone", "lamp river")


def test_intervals_use_students_t() -> None:
    mean, half = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 / 3**0.5)
    assert mean_ci([0.5])[1] != mean_ci([0.5])[1]  # nan: one seed has no interval
    diff, _ = paired_diff_ci([0.6, 0.7, 0.8], [0.5, 0.6, 0.7])
    assert diff == pytest.approx(0.1)
    with pytest.raises(ValueError):
        paired_diff_ci([1.0], [1.0, 2.0])
