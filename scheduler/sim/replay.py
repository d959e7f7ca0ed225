"""Replay a logged sweep under an early-exit policy, as if it ran live (`loraplane replay`; pure but for
reading the file).

The sweep is every trial's FULL curves, trained without early exit (`GET /v1/tasks/{id}/curves` of a task
with `early_exit: {"policy": "none"}` writes exactly this file; sweeps logged elsewhere can be converted).
One JSON object per line, one line per trial:

    {"trial_id": "t-07",                      non-empty string, unique in the file
     "hyperparameters": {"learning_rate": 2e-4, "lora_rank": 16, "batch_size": 4},   object, optional
     "samples_per_step": 4,                   integer >= 1: the batch size (rows per optimizer step)
     "tokens_per_step": 2048,                 integer >= 1: tokens per step (sizes ASHA's token budget)
     "total_steps": 500,                      integer >= 1: the steps the trial was given
     "train": [[1, 4, 2048, 2.31], ...],      [step, samples seen, tokens seen, loss] per point
     "val":   [[50, 200, 102400, 2.05], ...]} the same, one per validation

Steps are integers from 0 to total_steps, strictly increasing within each list; samples and tokens seen
are integers >= 0 (real counts, or step x per-step when that is all there is); a loss is a number, or null
for a non-finite one (a diverged step). Other keys (the API adds task_id, index, state and metric) are ignored.

Replay: all trials advance together, step by step (as the slots of a pack do). At every step at which
any trial has a validation point (or reaches the end of its curve), `decide()` sees every trial's curve up
to where it is, and a trial it stops trains no further samples: its curve ends there. A trial told to
"hold" pauses — its own step stands still, as the service checkpoints it and gives up its slot — until it
is resumed (kept by the warm-up ranking; it then continues its curve from where it paused) or stopped. So a
trial cut at the warm-up boundary is charged exactly the samples up to its boundary point, as in the
service, and a trial's `stopped_at` is a step of its own curve.

Reported (the JSON keys of `ReplayResult.summary()`):
  samples_saved_frac  1 - samples trained under the policy / samples trained in the sweep
  best_kept           the best trial (lowest best-validation loss in the full sweep; ties: earlier step,
                      then smaller id) survives: it is not stopped before the step of that best point, or
                      it is stopped for overfitting (its best adapter so far is exported)
  best_val_ratio      the best validation loss any trial reached under the policy / the best in the sweep
  spearman_warmup     Spearman's rank correlation, over the trials, between the validation loss at the
                      warm-up boundary (the first validation at or past warmup_ratio of a trial's steps;
                      ALTO's 5% unless the alto policy is given another) and the trial's best validation
                      loss; a property of the sweep, the same for every policy (ALTO A.2, Fig. 16)
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.early_exit.config import EarlyExitConfig
from scheduler.early_exit.policy import Decision, Point, TrialCurves, boundary_point, decide


class CurvesFormatError(ValueError):
    """A line of a curves file that is not a trial row; `line` counts from 1 (0: the file as a whole)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message


@dataclass(frozen=True)
class SweepTrial:
    curves: TrialCurves  # state "running": replay sets the state as the clock advances
    hyperparameters: dict[str, Any]


# ---- reading ---------------------------------------------------------------------------------------------


def _int(row: dict[str, Any], key: str, low: int) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{key}' must be an integer, got {json.dumps(value)}")
    if value < low:
        raise ValueError(f"'{key}' must be >= {low}, got {value}")
    return value


def _points(row: dict[str, Any], key: str, total_steps: int) -> tuple[Point, ...]:
    raw = row.get(key)
    if not isinstance(raw, list):
        raise ValueError(f"'{key}' must be a list of [step, samples, tokens, loss] points")
    out: list[Point] = []
    for i, item in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(item, list) or len(item) != 4:
            raise ValueError(f"{where} must be [step, samples, tokens, loss], got {json.dumps(item)}")
        step, samples, tokens, loss = item
        for name, value in (("step", step), ("samples", samples), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {name} must be an integer >= 0, got {json.dumps(value)}")
        if loss is None:
            loss = math.nan
        elif isinstance(loss, bool) or not isinstance(loss, int | float):
            raise ValueError(f"{where}: loss must be a number or null, got {json.dumps(loss)}")
        if step > total_steps:
            raise ValueError(f"{where}: step {step} is past total_steps {total_steps}")
        if out and step <= out[-1].step:
            raise ValueError(f"{where}: step {step} does not follow step {out[-1].step} (steps must increase)")
        out.append(Point(step, samples, tokens, float(loss)))
    return tuple(out)


def parse_row(row: Any) -> SweepTrial:
    """One trial row (a parsed JSON value); ValueError says what is wrong."""
    if not isinstance(row, dict):
        raise ValueError("a row must be a JSON object")
    trial_id = row.get("trial_id")
    if not isinstance(trial_id, str) or not trial_id:
        raise ValueError("'trial_id' must be a non-empty string")
    hyperparameters = row.get("hyperparameters", {})
    if not isinstance(hyperparameters, dict):
        raise ValueError("'hyperparameters' must be an object")
    total = _int(row, "total_steps", 1)
    curves = TrialCurves(trial_id, "running", total, _int(row, "samples_per_step", 1), _int(row, "tokens_per_step", 1),
                         train=_points(row, "train", total), val=_points(row, "val", total))
    return SweepTrial(curves, hyperparameters)


def parse_rows(lines: Iterable[str]) -> list[SweepTrial]:
    """Every trial of a curves file (blank lines skipped); CurvesFormatError names the first bad line."""
    sweep: list[SweepTrial] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            trial = parse_row(json.loads(line))
        except json.JSONDecodeError as exc:
            raise CurvesFormatError(number, f"invalid JSON: {exc.msg} (column {exc.colno})") from exc
        except RecursionError:  # json.loads recurses per level; a curves row nests three
            raise CurvesFormatError(number, "nested too deeply to read") from None
        except ValueError as exc:
            raise CurvesFormatError(number, str(exc)) from exc
        if trial.curves.trial_id in seen:
            raise CurvesFormatError(number, f"trial_id '{trial.curves.trial_id}' appears twice")
        seen.add(trial.curves.trial_id)
        sweep.append(trial)
    if not sweep:
        raise CurvesFormatError(0, "no trials in the file")
    return sweep


def read_curves(path: str | Path) -> list[SweepTrial]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_rows(f)
    except UnicodeDecodeError as exc:
        raise CurvesFormatError(0, f"not UTF-8 text ({exc.reason})") from exc


# ---- replaying -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialOutcome:
    trial_id: str
    stopped_at: int | None  # the step at which it was stopped; None: it trained to the end of its curve
    reason: str | None
    samples_trained: int
    samples_full: int
    best_val_full: float | None  # its best finite validation loss over the whole curve
    best_val_reached: float | None  # over the part it trained under the policy


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    outcomes: tuple[TrialOutcome, ...]
    best_trial: str | None
    best_kept: bool | None
    best_val_ratio: float | None
    spearman_warmup: float | None

    @property
    def samples_full(self) -> int:
        return sum(o.samples_full for o in self.outcomes)

    @property
    def samples_trained(self) -> int:
        return sum(o.samples_trained for o in self.outcomes)

    @property
    def samples_saved_frac(self) -> float | None:
        full = self.samples_full
        return None if full == 0 else 1 - self.samples_trained / full

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "trials": len(self.outcomes), "samples_saved_frac": self.samples_saved_frac,
                "best_kept": self.best_kept, "best_val_ratio": self.best_val_ratio,
                "spearman_warmup": self.spearman_warmup}


def _until(points: tuple[Point, ...], steps: list[int], step: int) -> tuple[Point, ...]:
    return points[: bisect.bisect_right(steps, step)]


def _samples(points: Iterable[Point]) -> int:
    return max((p.samples for p in points), default=0)


def _samples_at(trial: TrialCurves, step: int) -> int:
    """Samples seen after `step`: the last logged count at or before it, plus samples_per_step for each step
    after that point (curves logged sparsely), never more than the whole curve's."""
    before = [p for p in (*trial.train, *trial.val) if p.step <= step]
    last = max(before, key=lambda p: (p.step, p.samples), default=None)
    per_step = trial.samples_per_step
    guess = step * per_step if last is None else last.samples + (step - last.step) * per_step
    return min(guess, _samples((*trial.train, *trial.val)))


def _best(points: Iterable[Point]) -> Point | None:
    finite = [p for p in points if math.isfinite(p.loss)]
    return min(finite, key=lambda p: (p.loss, p.step)) if finite else None


def _ranks(xs: Sequence[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rho (Pearson's r of the tie-averaged ranks); None below two pairs or without spread."""
    if len(xs) != len(ys) or len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def replay(config: EarlyExitConfig, sweep: Sequence[SweepTrial]) -> ReplayResult:
    """Runs the sweep under `config` on a clock of steps (see the module docstring)."""
    trials = [s.curves for s in sweep]
    train_steps = {t.trial_id: [p.step for p in t.train] for t in trials}
    val_steps = {t.trial_id: [p.step for p in t.val] for t in trials}
    ends = {t.trial_id: max([0] + train_steps[t.trial_id][-1:] + val_steps[t.trial_id][-1:]) for t in trials}
    val_at = {t.trial_id: set(val_steps[t.trial_id]) for t in trials}
    own = {t.trial_id: 0 for t in trials}  # each trial's own step: it stands still while the trial is held
    held: set[str] = set()
    stopped: dict[str, tuple[int, Decision]] = {}

    def live(tid: str) -> bool:
        return tid not in stopped and own[tid] < ends[tid]

    while any(live(t.trial_id) and t.trial_id not in held for t in trials):
        moved = [t.trial_id for t in trials if live(t.trial_id) and t.trial_id not in held]
        for tid in moved:
            own[tid] += 1
        if not any(own[tid] in val_at[tid] or own[tid] >= ends[tid] for tid in moved):
            continue
        view = []
        for t in trials:
            tid = t.trial_id
            state = ("stopped_early" if tid in stopped else "completed" if own[tid] >= ends[tid]
                     else "waiting" if tid in held else "running")
            upto = own[tid]
            view.append(TrialCurves(tid, state, t.total_steps, t.samples_per_step, t.tokens_per_step,
                                    _until(t.train, train_steps[tid], upto), _until(t.val, val_steps[tid], upto)))
        for d in decide(config, view):
            if d.action == "stop":
                stopped[d.trial_id] = (own[d.trial_id], d)
                held.discard(d.trial_id)
            elif d.action == "hold":
                held.add(d.trial_id)
            else:
                held.discard(d.trial_id)
    # A trial still held here waited for trials that ended without a boundary point: decide() resumes it on
    # their last call, so none is left; should one be, it is charged where it stood.

    outcomes = []
    for t in trials:
        stop = stopped.get(t.trial_id)
        upto = stop[0] if stop else ends[t.trial_id]
        kept_val = _until(t.val, val_steps[t.trial_id], upto)
        full_best, reached_best = _best(t.val), _best(kept_val)
        full = _samples((*t.train, *t.val))
        outcomes.append(TrialOutcome(
            t.trial_id, stop[0] if stop else None, stop[1].reason if stop else None,
            _samples_at(t, stop[0]) if stop else full, full,
            full_best.loss if full_best else None, reached_best.loss if reached_best else None))

    best_kept = best_ratio = None
    ranked = [(b.loss, b.step, t.trial_id) for t in trials if (b := _best(t.val)) is not None]
    best_id = min(ranked)[2] if ranked else None
    if ranked:
        best_loss, best_step, _ = min(ranked)
        stop = stopped.get(best_id or "")
        best_kept = stop is None or stop[0] >= best_step or stop[1].reason == "overfitting"
        reached = [o.best_val_reached for o in outcomes if o.best_val_reached is not None]
        best_ratio = min(reached) / best_loss if reached and best_loss != 0 else None

    pairs = []
    for t in trials:
        at, best = boundary_point(config, t), _best(t.val)
        if at is not None and best is not None and math.isfinite(at.loss):
            pairs.append((at.loss, best.loss))
    rho = spearman([a for a, _ in pairs], [b for _, b in pairs])
    return ReplayResult(config.policy, tuple(outcomes), best_id, best_kept, best_ratio, rho)


# ---- the report --------------------------------------------------------------------------------------------


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def format_report(result: ReplayResult, source: str, config: EarlyExitConfig, sweep: Sequence[SweepTrial]) -> str:
    """The readable form: the summary, then one line per trial."""
    saved = result.samples_saved_frac
    reasons = Counter(o.reason for o in result.outcomes if o.reason)
    short = [s.curves.trial_id for s in sweep if (s.curves.val or s.curves.train) and
             max(p.step for p in (*s.curves.train, *s.curves.val)) < s.curves.total_steps]
    lines = [
        f"replay of {source}: {len(result.outcomes)} trials, policy {result.policy}",
        f"  samples saved       {_num(saved, '.1%')} ({result.samples_full - result.samples_trained:,} of "
        f"{result.samples_full:,})",
        f"  best trial          {result.best_trial or 'n/a'}: "
        f"{'kept' if result.best_kept else 'lost' if result.best_kept is not None else 'n/a'}",
        f"  best val ratio      {_num(result.best_val_ratio, '.4f')} (best val loss with early exit / without)",
        f"  spearman (warm-up)  {_num(result.spearman_warmup, '.3f')} (val loss at the {config.warmup_ratio:g} "
        "warm-up boundary vs best val loss)",
        "  stops               " + (", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) or "none"),
    ]
    if short:
        lines.append(f"  note: {len(short)} trial(s) end before total_steps (was the sweep run with early exit?)")
    cells = [["trial", "stopped at", "reason", "samples", "of", "best val (full)", "best val (reached)"]]
    for o in result.outcomes:
        cells.append([o.trial_id, "-" if o.stopped_at is None else str(o.stopped_at), o.reason or "-",
                      str(o.samples_trained), str(o.samples_full), _num(o.best_val_full, ".4f"),
                      _num(o.best_val_reached, ".4f")])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    rows = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths, strict=True)))
            for c in cells]
    rows.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [""] + rows) + "\n"
