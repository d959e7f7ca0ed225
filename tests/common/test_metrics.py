"""common/metrics.py: the task's own metric (normalisation, scoring, the pattern check, the ranking of trials)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from common.metrics import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_METRIC,
    GENERATIVE_METRICS,
    MAX_NEW_TOKENS_LIMIT,
    METRICS,
    PREFERENCE_METRICS,
    SCORED_METRICS,
    normalize_answer,
    pattern_error,
    rank_key,
    ranked_val_loss,
    score_answer,
    score_answers,
    selection_loss,
)


def test_the_metric_names_and_bounds() -> None:
    assert METRICS == ("loss", "exact_match", "contains", "regex", "json_valid", "reward_accuracy")
    assert DEFAULT_METRIC == "loss" and DEFAULT_METRIC not in SCORED_METRICS
    assert set(GENERATIVE_METRICS) == set(METRICS) - {"loss", "reward_accuracy"}
    assert set(SCORED_METRICS) == set(METRICS) - {"loss"} and PREFERENCE_METRICS == ("reward_accuracy",)
    assert 1 <= DEFAULT_MAX_NEW_TOKENS <= MAX_NEW_TOKENS_LIMIT == 512


@pytest.mark.parametrize(("text", "normal"), [
    ("Paris.", "paris"),
    (" paris", "paris"),
    ("Paris", "paris"),
    ("  The\tANSWER\n is   42 !", "the answer is 42"),
    ("Yes?!", "yes"),
    ("a;b:", "a;b"),
    ("Straße", "strasse"),  # case folded, not only lowered
    ("...", ""),
    ("", ""),
])
def test_normalisation(text: str, normal: str) -> None:
    assert normalize_answer(text) == normal


def test_the_docstrings_examples() -> None:
    # "Paris." and " paris" match "Paris", while "Paris, France" does not (contains does).
    assert score_answer("exact_match", "Paris.", "Paris") and score_answer("exact_match", " paris", "Paris")
    assert not score_answer("exact_match", "Paris, France", "Paris")
    assert score_answer("contains", "Paris, France", "Paris")


@pytest.mark.parametrize(("metric", "answer", "reference", "pattern", "passes"), [
    ("exact_match", "42", "42", None, True),
    ("exact_match", "The answer is 42", "42", None, False),
    ("exact_match", "  YES. ", "yes", None, True),
    ("contains", "The answer is 42.", "42", None, True),
    ("contains", "The answer is 41.", "42", None, False),
    ("contains", "anything", "", None, True),  # the empty reference is in every answer
    ("regex", "Answer: 42", "ignored", r"\d+", True),
    ("regex", "Answer: forty-two", "ignored", r"\d+", False),
    ("regex", "ANSWER", "", r"answer", False),  # on the raw answer: case matters unless the pattern says
    ("regex", "ANSWER", "", r"(?i)answer", True),
    ("json_valid", ' {"a": [1, 2]} \n', "", None, True),
    ("json_valid", "42", "", None, True),
    ("json_valid", "{'a': 1}", "", None, False),
    ("json_valid", "", "", None, False),
    ("json_valid", "NaN", "", None, True),  # Python's json reads it
])
def test_each_metric(metric: str, answer: str, reference: str, pattern: str | None, passes: bool) -> None:
    assert score_answer(metric, answer, reference, pattern) is passes


def test_regex_without_a_pattern_and_non_generative_metrics_raise() -> None:
    with pytest.raises(ValueError, match="needs a pattern"):
        score_answer("regex", "42", "42")
    for metric in ("loss", "bleu"):
        with pytest.raises(ValueError, match="not a generative metric"):
            score_answer(metric, "42", "42")


def test_score_answers_is_the_share_that_passes() -> None:
    assert score_answers("exact_match", ["Paris.", "Lyon", "rome"], ["Paris", "Nice", "Rome"]) == pytest.approx(2 / 3)
    assert score_answers("regex", ["a1", "b", "c3", "d"], ["", "", "", ""], pattern=r"\d") == 0.5
    assert score_answers("contains", [], []) == 0.0
    with pytest.raises(ValueError, match="2 answers for 1 references"):
        score_answers("contains", ["a", "b"], ["a"])


@pytest.mark.parametrize("pattern", [r"\d+", r"^(yes|no)\b", "(?i)paris", "(" * 200 + "a" + ")" * 200])
def test_a_pattern_that_compiles_has_no_error(pattern: str) -> None:
    assert pattern_error(pattern) is None


@pytest.mark.parametrize(("pattern", "says"), [
    ("(unclosed", "missing )"),
    ("[a-", "missing ]"),
    ("\\", "trailing \\"),
    # The policy's limits (tests/common/test_regex_policy.py).
    ("a{99999999999}", "repetition count 99999999999 is over the limit of 1000"),
    ("(" * 2000 + ")" * 2000, "pattern length 4000 is over the limit of 500"),
])
def test_a_pattern_that_does_not_compile_says_why(pattern: str, says: str) -> None:
    why = pattern_error(pattern)
    assert why is not None and says in why


def _best(metric: str, trials: list[dict[str, Any]]) -> int:
    return int(min(trials, key=lambda t: rank_key(metric, **t))["index"])


def test_rank_key_by_loss_is_the_lowest_validation_loss() -> None:
    trials: list[dict[str, Any]] = [
        {"metric_score": 0.9, "val_loss": 1.0, "last_train_loss": 0.1, "index": 0},
        {"metric_score": 0.1, "val_loss": 0.5, "last_train_loss": 0.9, "index": 1},
        {"metric_score": None, "val_loss": None, "last_train_loss": 0.01, "index": 2},
    ]
    assert _best("loss", trials) == 1  # the scores do not count
    assert _best("loss", trials[::-1]) == 1
    # Without a validation loss: after those with one, by train loss; then by index.
    assert _best("loss", [trials[2], {**trials[2], "last_train_loss": None, "index": 3}]) == 2
    assert _best("loss", [{**trials[1], "index": 5}, {**trials[1], "index": 4}]) == 4


def test_rank_key_by_a_generative_metric_is_the_highest_score_then_the_loss() -> None:
    trials: list[dict[str, Any]] = [
        {"metric_score": 0.5, "val_loss": 1.0, "last_train_loss": 1.0, "index": 0},
        {"metric_score": 0.25, "val_loss": 0.1, "last_train_loss": 0.1, "index": 1},
        {"metric_score": 0.5, "val_loss": 0.9, "last_train_loss": 1.0, "index": 2},
        {"metric_score": None, "val_loss": 0.01, "last_train_loss": 0.01, "index": 3},
    ]
    for metric in GENERATIVE_METRICS:
        assert _best(metric, trials) == 2  # 0.5, and the lower validation loss of the two at 0.5
        assert _best(metric, trials[::-1]) == 2
        assert _best(metric, [trials[1], trials[3]]) == 1  # a score beats none, whatever the loss
        assert _best(metric, [trials[3], {**trials[3], "val_loss": 0.001, "index": 4}]) == 4  # none: by loss
        assert _best(metric, [trials[0], {**trials[0], "index": 6}]) == 0  # all equal: the lower index
    assert rank_key("exact_match", metric_score=0.0, val_loss=None, last_train_loss=None, index=0) < rank_key(
        "exact_match", metric_score=None, val_loss=0.0, last_train_loss=0.0, index=0)
    assert rank_key("loss", metric_score=None, val_loss=None, last_train_loss=None, index=0)[1] == math.inf


def test_a_trial_s_curve_is_scored_by_its_smoothed_lowest_point_not_its_one_lucky_evaluation() -> None:
    # Trial "lucky" dipped once (noise on a small validation split) and came back; trial "steady" stayed low.
    lucky = [2.0, 1.20, 0.80, 1.25, 1.30]
    steady = [2.0, 1.00, 0.95, 0.90, 0.92]
    assert min(lucky) < min(steady)  # by its lowest point, "lucky" would win
    assert selection_loss(lucky) == pytest.approx(min(2.0, 1.6, 1.2, 1.225, 1.2625))
    assert selection_loss(steady) == pytest.approx(min(2.0, 1.5, 1.225, 1.0625, 0.99125))
    trials = [{"metric_score": None, "val_loss": selection_loss(curve), "last_train_loss": None, "index": i}
              for i, curve in enumerate([lucky, steady])]
    assert _best("loss", trials) == 1  # smoothed, "steady" wins
    # One point is that point; no points, no score; a trial stored without a smoothed score ranks by its lowest.
    assert selection_loss([0.7]) == 0.7
    assert selection_loss([]) is None
    assert ranked_val_loss(None, 0.5) == 0.5 and ranked_val_loss(0.6, 0.5) == 0.6


@pytest.mark.timeout(60)  # Python's re would search one of these answers for hours
def test_a_pattern_that_backtracks_without_end_elsewhere_is_searched_in_linear_time() -> None:
    pattern = "(a|aa)+$"  # exponential backtracking on a run of a's that does not end the string (not in RE2)
    assert pattern_error(pattern) is None and score_answer("regex", "aaaa", "", pattern)
    assert score_answers("regex", ["a" * 5000 + "!"] * 3, [""] * 3, pattern) == 0.0
    assert score_answers("regex", ["a" * 5000] * 3, [""] * 3, pattern) == 1.0


def test_an_answer_that_is_not_valid_unicode_matches_nothing() -> None:
    assert score_answers("regex", ["\ud800 42", "42"], ["", ""], r"\d+") == 0.5
