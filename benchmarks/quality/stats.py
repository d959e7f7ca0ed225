"""Means with 95% confidence intervals over seeds (Student's t: three to ten seeds are too few for the normal)."""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 95% critical values of Student's t by degrees of freedom (1-30); beyond, the normal's 1.96.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval); the half-width is nan for fewer than two values."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = T95[n - 2] if n - 1 <= len(T95) else 1.96
    return mean, t * sd / math.sqrt(n)


def paired_diff_ci(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean and 95% half-width of ``a - b`` paired by seed: whether one choice beats another on the same splits."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} against {len(b)} values: pairs need both")
    return mean_ci([x - y for x, y in zip(a, b, strict=True)])
