"""Ways of picking a grid's winner from validation curves (benchmarks/quality/selection.py), on contrived curves
where they disagree, and their comparison on a run's cells."""

from __future__ import annotations

import pytest

from benchmarks.quality.selection import compare, pick, score_ema, score_mean_last3

# "lucky" dips once to the lowest point and is otherwise worse; "steady" is better at every point but that one,
# and its last point is a little worse than lucky's: the rules disagree.
CURVES = {
    "lucky": [[10, 1.20], [20, 0.80], [30, 1.15], [40, 1.00]],
    "steady": [[10, 1.00], [20, 0.95], [30, 0.90], [40, 1.02]],
}


def test_a_single_dip_wins_by_its_lowest_point_but_not_smoothed() -> None:
    assert pick(CURVES, "min") == "lucky"
    assert pick(CURVES, "last") == "lucky"
    assert pick(CURVES, "mean_last3") == "steady"
    assert pick(CURVES, "ema") == "steady"
    assert score_mean_last3(CURVES["steady"]) == pytest.approx((0.95 + 0.90 + 1.02) / 3)
    # EMA with weight 0.5: 1.0, 0.975, 0.9375, 0.97875 -> its lowest is 0.9375.
    assert score_ema(CURVES["steady"]) == pytest.approx(0.9375)


def test_points_are_ordered_by_step_and_trials_without_a_curve_are_not_ranked() -> None:
    assert score_mean_last3([[30, 3.0], [10, 1.0], [20, 2.0], [5, 9.0]]) == pytest.approx(2.0)
    assert pick({"empty": [], "one": [[1, 5.0]]}, "min") == "one"
    with pytest.raises(ValueError):
        pick({"empty": []}, "ema")


def test_compare_reports_each_rules_test_score_and_regret() -> None:
    cells = [{"task": "topics", "winners": {"oracle": {"all": {"lucky": 0.40, "steady": 0.60},
                                                      "val_curves": CURVES}}},
             {"task": "topics", "winners": {"oracle": {"all": {"lucky": 0.50, "steady": 0.70},
                                                      "val_curves": CURVES}}},
             {"task": "topics", "winners": {}}]  # a cell without the grid's curves is left out
    rows = {row[1]: row for row in compare({"cells": cells})}
    assert rows["min"][:3] == ["topics", "min", 2]
    assert rows["min"][3].startswith("0.450") and rows["min"][4].startswith("0.200")
    assert rows["ema"][3].startswith("0.650") and rows["ema"][4].startswith("0.000")
