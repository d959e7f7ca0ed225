"""Ways of picking a grid's winner from its trials' validation curves, judged on a quality run's test scores
(issue 33: a trial's score should not be one noisy point).

    python -m benchmarks.quality.selection benchmarks/results/quality-<model>-<device>-<date>.json

A run of `benchmarks/quality/run.py` keeps, for each cell's `grid-none` task, every trial's validation curve and
its adapter's test score (the adapter is the trial's best-validation checkpoint, whatever rule picks the trial). Each
rule below picks one trial per cell from the curves alone; its test score, and its regret against the oracle (the
trial best on the test rows), are compared per task with 95% intervals over the cells. Rules:

- ``min``: the lowest validation loss at any point (the service's rule until 2026-11-26);
- ``last``: the last validation loss;
- ``mean_last3``: the mean of the last three validation losses;
- ``ema``: the lowest point of the curve smoothed by an exponential average (half weight on the newest): the
  service's rule (`common.metrics.selection_loss`, which this calls).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from benchmarks.quality.stats import mean_ci
from common.metrics import selection_loss

Curve = Sequence[Sequence[float]]  # [[step, loss], ...] in step order


def _losses(curve: Curve) -> list[float]:
    return [float(point[1]) for point in sorted(curve, key=lambda p: p[0])]


def score_min(curve: Curve) -> float:
    return min(_losses(curve))


def score_last(curve: Curve) -> float:
    return _losses(curve)[-1]


def score_mean_last3(curve: Curve) -> float:
    tail = _losses(curve)[-3:]
    return sum(tail) / len(tail)


def score_ema(curve: Curve) -> float:
    score = selection_loss(_losses(curve))
    assert score is not None, "a curve of no points"
    return score


RULES: dict[str, Callable[[Curve], float]] = {"min": score_min, "last": score_last, "mean_last3": score_mean_last3,
                                              "ema": score_ema}


def pick(curves: dict[str, Curve], rule: str) -> str:
    """The trial ``rule`` ranks first (the lowest score; ties by trial id). Trials without a curve are not ranked.

    Raises:
        ValueError: no trial has a validation curve.
    """
    scored = {trial: RULES[rule](curve) for trial, curve in curves.items() if curve}
    if not scored:
        raise ValueError("no trial has a validation curve")
    return min(scored, key=lambda trial: (scored[trial], trial))


def compare(result: dict[str, Any]) -> list[list[Any]]:
    """Per task and rule: the picked trials' mean test score and mean regret against the oracle, with 95%
    intervals over the run's cells (sizes and seeds)."""
    by_task: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for cell in result["cells"]:
        oracle = cell.get("winners", {}).get("oracle")
        if not oracle or not oracle.get("val_curves"):
            continue
        tests: dict[str, float] = oracle["all"]
        ceiling = max(tests.values())
        for rule in RULES:
            chosen = tests[pick(oracle["val_curves"], rule)]
            by_task.setdefault(cell["task"], {}).setdefault(rule, []).append((chosen, ceiling - chosen))
    rows: list[list[Any]] = []
    for task, rules in sorted(by_task.items()):
        for rule, pairs in rules.items():
            score, score_half = mean_ci([p[0] for p in pairs])
            regret, regret_half = mean_ci([p[1] for p in pairs])
            rows.append([task, rule, len(pairs), f"{score:.3f}" + _half(score_half),
                         f"{regret:.3f}" + _half(regret_half)])
    return rows


def _half(half: float) -> str:
    return "" if half != half else f" ±{half:.3f}"  # nan: one cell, no interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a quality-*.json that benchmarks/quality/run.py wrote")
    args = parser.parse_args()
    print_table(["task", "rule", "cells", "test score", "regret vs oracle"],
                compare(json.loads(args.result.read_text())))


if __name__ == "__main__":
    main()
