"""The losses a hollow worker reports: replayed from the recorded curves of the committed sweeps
(benchmarks/results/sweeps/, the `loraplane replay` format read by `scheduler.sim.replay.read_curves`), so that the
scheduler's early exit decides on real curve shapes.

Which curve a trial replays is pure and deterministic (`pick_curve`): the dataset's sweeps by the trial's data (every
trial of a task reads the same rows, so a task's trials all replay one dataset's sweep, whose losses share a scale),
the sweep's repeat by the trial's seed, and in it the configuration nearest the trial's learning rate, rank and batch
size. The curve is stretched to the trial's own step count (`train_loss`, `val_loss`): its step s of T reads the
sweep's point at s/T of the sweep's steps. Only `load_library` reads files.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from scheduler.sim.replay import read_curves

# The committed sweeps of issue 6 and 17 (benchmarks/results/sweeps/SUMMARY.md): every trial's full curves, trained
# without early exit. Files `<dataset>-<model>-full[-<repeat>].jsonl`; the live runs beside them stopped trials early.
DEFAULT_CURVES_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sweeps"
FULL_SWEEPS_GLOB = "*-full*.jsonl"


@dataclass(frozen=True)
class Curve:
    """One recorded trial: its configuration, its train loss at every step 1..total_steps (NaN where the sweep had
    none) and its validations as (step, loss), ascending."""

    source: str  # "<file stem>/<trial id>": what a hollow adapter names as the curve it replayed
    learning_rate: float
    lora_rank: int
    batch_size: int
    total_steps: int
    train: tuple[float, ...]
    val: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Library:
    """The recorded curves, grouped by dataset (``groups[name]``: its repeats, each a sweep's curves)."""

    groups: dict[str, tuple[tuple[Curve, ...], ...]]

    @property
    def size(self) -> int:
        return sum(len(sweep) for repeats in self.groups.values() for sweep in repeats)


def _curve(stem: str, trial_id: str, hyperparameters: dict[str, Any], total: int,
           train: Sequence[tuple[int, float]], val: Sequence[tuple[int, float]]) -> Curve:
    by_step = dict(train)
    hp = hyperparameters
    return Curve(source=f"{stem}/{trial_id}", learning_rate=float(hp.get("learning_rate", 1e-4)),
                 lora_rank=int(hp.get("lora_rank", 8)), batch_size=int(hp.get("batch_size", 1)),
                 total_steps=total, train=tuple(by_step.get(s, math.nan) for s in range(1, total + 1)),
                 val=tuple(val))


@lru_cache(maxsize=4)
def load_library(directory: Path = DEFAULT_CURVES_DIR) -> Library:
    """Every full sweep under ``directory``, read once per process (all hollow workers of a process share it: ~200
    curves, a few MB). Raises FileNotFoundError when there is none (a hollow worker cannot make losses up)."""
    files = sorted(Path(directory).glob(FULL_SWEEPS_GLOB))
    if not files:
        raise FileNotFoundError(f"no recorded sweep ({FULL_SWEEPS_GLOB}) under {directory}: a hollow worker replays "
                                "their losses (benchmarks/results/sweeps/ of the repository, or --curves DIR)")
    groups: dict[str, list[tuple[Curve, ...]]] = {}
    for path in files:
        sweep = tuple(
            _curve(path.stem, t.curves.trial_id, t.hyperparameters, t.curves.total_steps,
                   [(p.step, p.loss) for p in t.curves.train], [(p.step, p.loss) for p in t.curves.val])
            for t in read_curves(path))
        groups.setdefault(path.stem.split("-full")[0], []).append(sweep)
    return Library({name: tuple(repeats) for name, repeats in sorted(groups.items())})


def data_key(rows: Sequence[dict[str, Any]]) -> int:
    """A stable number for a trial's training rows (the same for every trial of a task): their count and first row."""
    first = json.dumps(rows[0], sort_keys=True) if rows else ""
    return zlib.crc32(f"{len(rows)}\0{first}".encode())


def _distance(curve: Curve, learning_rate: float, lora_rank: int, batch_size: int) -> float:
    """How far a recorded configuration is from the trial's, in log steps (the learning rate weighs most: it shapes
    a curve most)."""
    return (abs(math.log(learning_rate / curve.learning_rate))
            + 0.5 * abs(math.log2(max(lora_rank, 1) / max(curve.lora_rank, 1)))
            + 0.5 * abs(math.log2(max(batch_size, 1) / max(curve.batch_size, 1))))


def pick_curve(library: Library, *, data: int, seed: int, learning_rate: float, lora_rank: int,
               batch_size: int) -> Curve:
    """The curve a trial replays (pure): its dataset's sweeps by ``data`` (`data_key`), the repeat by ``seed``, and
    in it the configuration nearest the trial's (ties: the first in the sweep's order)."""
    names = sorted(library.groups)
    repeats = library.groups[names[data % len(names)]]
    sweep = repeats[seed % len(repeats)]
    return min(sweep, key=lambda c: _distance(c, learning_rate, lora_rank, batch_size))


def _at(curve: Curve, step: int, total_steps: int) -> float:
    """Where the trial's ``step`` of ``total_steps`` falls on the curve's own steps."""
    return step / max(total_steps, 1) * curve.total_steps


def train_loss(curve: Curve, step: int, total_steps: int) -> float:
    """The trial's train loss after ``step`` (1..total_steps): the recorded step's loss at the same share of the run
    (a single step's loss, noisy as a real one is)."""
    index = min(max(round(_at(curve, step, total_steps)), 1), curve.total_steps) - 1
    return curve.train[index]


def val_loss(curve: Curve, step: int, total_steps: int) -> float:
    """The trial's validation loss after ``step``: the recorded validations interpolated at the same share of the
    run (before the first one: the first; after the last: the last)."""
    points = curve.val
    if not points:
        return train_loss(curve, step, total_steps)
    x = _at(curve, step, total_steps)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]
