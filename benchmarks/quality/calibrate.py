"""Which variant of each kind of task the quality benchmark runs (issue 33): the one whose grid of configurations
scores most apart on the test rows, among those that neither the default config fails nor every config solves.

    python -m benchmarks.quality.calibrate benchmarks/results/calibration/quality-<model>-<device>-<date>.json

reads a run of benchmarks/quality/run.py over the candidates (``tasks.CANDIDATES``) with the arms ``default``,
``grid-none`` and ``oracle`` (every grid trial's test score), at a seed that no reported cell uses, and prints a
table of each candidate's numbers and, on its last line, the tasks picked (one per kind).

The rule, per kind: a candidate is eligible if the default config scores at least ``FLOOR`` (it is not at the floor,
where no configuration learns it) and the best grid trial at most ``CEILING`` (not every configuration can solve it);
among the eligible the one with the widest spread of the grid's trials (best minus worst) wins, as the task on which
choosing a configuration matters most. A kind with no eligible candidate takes the widest spread of all, and the
table says so; a kind with one candidate takes it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.quality.tasks import CANDIDATES, TASKS

FLOOR = 0.05
CEILING = 0.97


@dataclass(frozen=True)
class Candidate:
    task: str
    default: float
    worst: float
    best: float

    @property
    def spread(self) -> float:
        return self.best - self.worst

    @property
    def eligible(self) -> bool:
        return self.default >= FLOOR and self.best <= CEILING


def candidates(cells: list[dict[str, Any]]) -> dict[str, Candidate]:
    """Each calibrated task's numbers, from a run's cells (one seed: the first cell of each task)."""
    found: dict[str, Candidate] = {}
    for cell in cells:
        trials = cell.get("winners", {}).get("oracle", {}).get("all", {})
        if cell["task"] in found or "default" not in cell["scores"] or not trials:
            continue
        found[cell["task"]] = Candidate(cell["task"], cell["scores"]["default"], min(trials.values()),
                                        max(trials.values()))
    return found


def pick(found: dict[str, Candidate]) -> dict[str, tuple[str, bool]]:
    """Per kind with a calibrated candidate: (the task picked, whether it was eligible)."""
    picked: dict[str, tuple[str, bool]] = {}
    for kind, names in CANDIDATES.items():
        if len(names) == 1:  # nothing to choose: the kind's one task, calibrated or not
            picked[kind] = (names[0], True)
            continue
        mine = [found[name] for name in names if name in found]
        if not mine:
            continue
        eligible = [c for c in mine if c.eligible]
        best = max(eligible or mine, key=lambda c: c.spread)
        picked[kind] = (best.task, bool(eligible))
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a run.py result over the candidates")
    args = parser.parse_args()
    found = candidates(json.loads(args.result.read_text())["cells"])
    picked = pick(found)
    print(f"{'task':<16} {'kind':<30} {'default':>8} {'worst':>6} {'best':>6} {'spread':>7}  eligible")
    for name, c in sorted(found.items(), key=lambda item: TASKS[item[0]].kind):
        print(f"{name:<16} {TASKS[name].kind:<30} {c.default:8.3f} {c.worst:6.3f} {c.best:6.3f} {c.spread:7.3f}  "
              f"{'yes' if c.eligible else 'no'}")
    for kind, (task, eligible) in picked.items():
        print(f"{kind}: {task}" + ("" if eligible else " (no candidate eligible: the widest spread)"))
    print(" ".join(task for task, _ in picked.values()))


if __name__ == "__main__":
    main()
