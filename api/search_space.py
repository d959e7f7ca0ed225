"""From a validated search space to the list of trial configurations. Pure: no I/O, no pydantic.

A space maps each dimension to either a list of values or a `Range`. `grid` takes the Cartesian
product in a fixed order (dimensions in `DIMENSIONS` order, the last one varying fastest); `random`
draws with `random.Random(seed)`, so one seed always gives the same trials.

    >>> [(c["learning_rate"], c["lora_rank"], c["lora_alpha"])
    ...  for c in expand_grid({"learning_rate": [1e-4, 1e-3], "lora_rank": [8, 16]})]
    [(0.0001, 8, 16.0), (0.0001, 16, 32.0), (0.001, 8, 16.0), (0.001, 16, 32.0)]
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DIMENSIONS = ("learning_rate", "lora_rank", "lora_alpha", "batch_size", "lora_dropout", "target_modules")
INTEGER_DIMENSIONS = frozenset({"lora_rank", "batch_size"})
# lora_alpha has no list default: left out, it is 2 x each trial's rank (torchtune's and Predibase's rule).
DEFAULTS: dict[str, list[Any]] = {
    "learning_rate": [2e-4],
    "lora_rank": [8],
    "batch_size": [4],
    "lora_dropout": [0.0],
    "target_modules": [["q_proj", "v_proj"]],
}
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
    """Puts the keys in DIMENSIONS order and fills lora_alpha = 2 x rank where it was left out."""
    if "lora_alpha" not in config:
        config["lora_alpha"] = float(2 * config["lora_rank"])
    return {name: config[name] for name in DIMENSIONS}


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
