"""From a validated search space to the list of trial configurations. Pure: no I/O, no pydantic.

A space maps each dimension to either a list of values or a `Range`. `grid` takes the Cartesian
product in a fixed order (dimensions in `DIMENSIONS` order, the last one varying fastest); `random`
draws with `random.Random(seed)`, so one seed always gives the same trials.

    >>> [(c["learning_rate"], c["lora_rank"], c["lora_alpha"])
    ...  for c in expand_grid({"learning_rate": [1e-4, 1e-3], "lora_rank": [8, 16]})]
    [(0.0001, 8, 16.0), (0.0001, 16, 32.0), (0.001, 8, 16.0), (0.001, 16, 32.0)]

A dimension left out takes its default (`DEFAULTS`: one value, best-known practice for a single trial); a task
that gives no space at all gets `auto_space` (a small grid from the model's and the dataset's size). The
measurements behind both: docs/defaults.md.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

AUTO: Final = "auto"  # a task's search_space that asks for `auto_space`
DIMENSIONS = ("learning_rate", "lora_rank", "lora_alpha", "batch_size", "lora_dropout", "target_modules", "beta")
# Dimensions only some tasks' trials have: `beta`, a DPO task's (objective "dpo"), the strength of its pull towards
# the base model; an SFT trial's configuration has no such key.
OPTIONAL_DIMENSIONS = frozenset({"beta"})
INTEGER_DIMENSIONS = frozenset({"lora_rank", "batch_size"})
# lora_alpha has no list default: left out, it is 2 x each trial's rank (torchtune's and Predibase's rule).
# Adapters on every linear layer (QLoRA's finding, PEFT's "all-linear"): docs/defaults.md measures them against
# the q_proj/v_proj default this service had before.
# The auto grid: three learning rates around a centre set by the model's size, two ranks set by the dataset's.
# Centres: 1e-3 measured best on SmolLM2-135M (benchmarks/results/sweeps), 2e-4 and 1e-4 QLoRA's for 7-13B and
# 33-65B models (Dettmers et al. 2023, table 9); a model of unknown size gets the middle one.
AUTO_LR_CENTRES: tuple[tuple[float, float], ...] = ((1e9, 1e-3), (2e10, 2e-4), (math.inf, 1e-4))
AUTO_LR_UNKNOWN_SIZE = 2e-4
AUTO_LR_FACTORS = (0.3, 1.0, 3.0)
# A DPO task's learning rates, its defaults and its auto grid's, are the SFT ones scaled by this: preference tuning is
# run an order of magnitude below SFT or more (Zephyr: SFT 2e-5, DPO 5e-7, Tunstall et al. 2023; TRL's LoRA DPO
# examples 5e-6 to 5e-5). Its beta left out is the DPO paper's and TRL's 0.1.
DPO_LR_SCALE = 0.1
DEFAULT_DPO_BETA = 0.1
# The learning rate left out is the auto grid's centre for the model's size (`default_learning_rate`, applied by
# `with_size_defaults` where the size is known); here, that rule's value for a model of unknown size.
DEFAULTS: dict[str, list[Any]] = {
    "learning_rate": [AUTO_LR_UNKNOWN_SIZE],
    "lora_rank": [8],
    "batch_size": [4],
    "lora_dropout": [0.0],
    "target_modules": ["all-linear"],
}
# How every trial trains unless the task's `training` says otherwise: a linear warm-up over 3% of its steps
# (QLoRA's and the Hugging Face recipes' ratio), then a cosine decay to zero.
DEFAULT_LR_SCHEDULE: Final = "cosine"
DEFAULT_WARMUP_RATIO = 0.03
AUTO_RANKS: tuple[tuple[float, tuple[int, int]], ...] = ((10_000, (4, 16)), (100_000, (8, 32)), (math.inf, (16, 64)))
# Random search draws at most this many times per wanted trial before settling for fewer unique ones.
MAX_DRAWS_PER_TRIAL = 20


@dataclass(frozen=True)
class Range:
    min: float
    max: float
    num: int | None = None
    scale: str = "linear"  # "linear" | "log"


Dimension = list[Any] | Range
Space = Mapping[str, Dimension]


class SearchSpaceError(ValueError):
    """A space that is valid value by value but cannot be expanded; `param` is relative to the space."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def warmup_steps_for(total_steps: int, warmup_steps: int | None) -> int:
    """A trial's warm-up steps: the task's `training.warmup_steps` when it gives them, else 3% of the trial's own
    steps, rounded up (a trial of one step gets none).

    >>> warmup_steps_for(500, None), warmup_steps_for(500, 0), warmup_steps_for(1, None)
    (15, 0, 0)
    """
    if warmup_steps is not None:
        return warmup_steps
    return math.ceil(round(DEFAULT_WARMUP_RATIO * total_steps, 9)) if total_steps > 1 else 0


def default_learning_rate(parameters: int | None) -> float:
    """The learning rate for a model of ``parameters`` (None: unknown): the auto grid's centre. A single trial
    whose space leaves the learning rate out gets it too: on SmolLM2-135M, 1e-3 against the 2e-4 every size got
    before beat it on all 5 tasks of the quality benchmark, both seeds (docs/defaults.md).

    >>> default_learning_rate(135_000_000), default_learning_rate(8_000_000_000), default_learning_rate(None)
    (0.001, 0.0002, 0.0002)
    """
    if parameters is None:
        return AUTO_LR_UNKNOWN_SIZE
    return next(lr for size, lr in AUTO_LR_CENTRES if parameters < size)


def with_size_defaults(space: Space, parameters: int | None, *, dpo: bool = False) -> dict[str, Dimension]:
    """``space`` with a learning rate left out set to the model's (`default_learning_rate`; a DPO task's scaled by
    `DPO_LR_SCALE`) and, for a DPO task, a beta left out set to `DEFAULT_DPO_BETA`."""
    out = dict(space)
    out.setdefault("learning_rate", [_clean(default_learning_rate(parameters) * (DPO_LR_SCALE if dpo else 1.0))])
    if dpo:
        out.setdefault("beta", [DEFAULT_DPO_BETA])
    return out


def auto_space(parameters: int | None, train_rows: int, *, dpo: bool = False) -> dict[str, Dimension]:
    """The search space of a task that gives none (`search_space` omitted or "auto"): learning rates around a
    centre for the model's size (`parameters`, None when unknown; a DPO task's a tenth of it) x two ranks for the
    number of training rows; the other dimensions keep their defaults (a DPO task's beta `DEFAULT_DPO_BETA`). Six
    trials.

    >>> auto_space(135_000_000, 2_000)
    {'learning_rate': [0.0003, 0.001, 0.003], 'lora_rank': [4, 16]}
    """
    centre = default_learning_rate(parameters) * (DPO_LR_SCALE if dpo else 1.0)
    ranks = next(r for rows, r in AUTO_RANKS if train_rows < rows)
    space: dict[str, Dimension] = {"learning_rate": [_clean(centre * f) for f in AUTO_LR_FACTORS],
                                   "lora_rank": list(ranks)}
    return space | {"beta": [DEFAULT_DPO_BETA]} if dpo else space


def _clean(x: float) -> float:
    # 10 ** log10(1e-3) is 0.0010000000000000002; users should see the number they meant.
    return float(f"{x:.12g}")


def _dedupe(values: list[Any]) -> list[Any]:
    seen: set[str] = set()
    out = []
    for v in values:
        key = json.dumps(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def range_points(r: Range, *, integer: bool) -> list[Any]:
    """`num` points from min to max, evenly spaced in the range's scale (rounded and deduplicated for ints)."""
    assert r.num is not None and r.num >= 1, "range_points needs num"
    lo, hi = (math.log(r.min), math.log(r.max)) if r.scale == "log" else (r.min, r.max)
    points = []
    for i in range(r.num):
        t = lo if r.num == 1 else lo + (hi - lo) * i / (r.num - 1)
        x = math.exp(t) if r.scale == "log" else t
        points.append(int(round(x)) if integer else _clean(x))
    return _dedupe(points)


def _filled(space: Space) -> dict[str, Dimension]:
    out: dict[str, Dimension] = {}
    for name in DIMENSIONS:
        dim = space.get(name)
        if dim is None:
            if name in DEFAULTS:
                out[name] = DEFAULTS[name]
        else:
            out[name] = dim if isinstance(dim, Range) else _dedupe(list(dim))
    return out


def _grid_values(name: str, dim: Dimension) -> list[Any]:
    if isinstance(dim, Range):
        if dim.num is None:
            raise SearchSpaceError(f"{name}.num", "A grid search needs 'num' points for a range.")
        return range_points(dim, integer=name in INTEGER_DIMENSIONS)
    if not dim:
        raise SearchSpaceError(name, "The list of values is empty.")
    return dim


def _complete(config: dict[str, Any]) -> dict[str, Any]:
    """Puts the keys in DIMENSIONS order and fills lora_alpha = 2 x rank where it was left out (an optional
    dimension the space lacks stays out)."""
    if "lora_alpha" not in config:
        config["lora_alpha"] = float(2 * config["lora_rank"])
    return {name: config[name] for name in DIMENSIONS if name in config}


def grid_size(space: Space) -> int:
    """How many trials `expand_grid` makes, without making them (a space can multiply out huge)."""
    return math.prod(len(_grid_values(n, d)) for n, d in _filled(space).items())


def expand_grid(space: Space) -> list[dict[str, Any]]:
    dims = _filled(space)
    names = list(dims)
    axes = [_grid_values(n, d) for n, d in dims.items()]
    return [_complete(dict(zip(names, combo, strict=True))) for combo in itertools.product(*axes)]


def _draw(rng: random.Random, name: str, dim: Dimension) -> Any:
    if not isinstance(dim, Range):
        if not dim:
            raise SearchSpaceError(name, "The list of values is empty.")
        return rng.choice(dim)
    integer = name in INTEGER_DIMENSIONS
    if dim.num is not None:  # a discretised range: draw one of its grid points
        return rng.choice(range_points(dim, integer=integer))
    if dim.scale == "log":
        x = math.exp(rng.uniform(math.log(dim.min), math.log(dim.max)))
    else:
        x = rng.uniform(dim.min, dim.max)
    if integer:
        return min(int(dim.max), max(int(dim.min), int(round(x))))
    return _clean(x)


def sample_random(space: Space, n: int, seed: int) -> list[dict[str, Any]]:
    """Up to `n` distinct configurations drawn with `random.Random(seed)`.

    Duplicates are dropped; a space with fewer than `n` distinct points gives fewer trials.
    """
    dims = _filled(space)
    rng = random.Random(seed)
    configs: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(n * MAX_DRAWS_PER_TRIAL):
        if len(configs) == n:
            break
        config = _complete({name: _draw(rng, name, dim) for name, dim in dims.items()})
        key = json.dumps(config, sort_keys=True)
        if key not in seen:
            seen.add(key)
            configs.append(config)
    return configs
