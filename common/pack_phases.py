"""A pack's phases: where its wall time went, as its worker reports them in `pack.profile`'s `phases` (seconds).

One reading for the API (GET /v1/admin/packs/{id}, the dashboard) and the worker's metrics: the named phases,
old names read as the new ones, and `other_s`, the wall time no training-thread phase accounts for. The report is
the worker's word, kept as JSON: a missing or malformed value reads as None, never as an error.
"""

from __future__ import annotations

import math
from typing import Any

# The training-thread phases, which add up to the pack's wall time with `other_s`, in the order a pack lives them.
WALL_PHASES = ("load_s", "capture_s", "steps_s", "validation_s", "metric_s", "snapshot_s", "export_s", "idle_s")
# Writer-thread time: it runs beside the training thread (what the pack's end waits for it is `idle_s`).
PERSIST = "persist_s"
# Every phase of a profile, `other_s` included, as the API lists them.
PHASES = (*WALL_PHASES[:6], PERSIST, *WALL_PHASES[6:], "other_s")
# What workers before issue 30 called three of them: the same measurements under their first names.
OLD_NAMES = {"snapshot_s": "checkpoints_s", "export_s": "exports_s", "idle_s": "waiting_s"}


def number(value: Any) -> float | None:
    """A finite number from a worker's JSON report, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def phase_seconds(raw: dict[str, Any]) -> dict[str, float | None]:
    """Every phase of `PHASES` from a report's `phases` (None: not measured), with `other_s`: `wall_s` less the
    training-thread phases (None without `wall_s`)."""
    out = {name: number(raw[name] if name in raw else raw.get(OLD_NAMES.get(name, ""))) for name in WALL_PHASES}
    out[PERSIST] = number(raw.get(PERSIST))
    wall = number(raw.get("wall_s"))
    named = sum(out[name] or 0.0 for name in WALL_PHASES)
    # Each phase comes rounded to the millisecond: their sum may pass the wall time by a hair.
    out["other_s"] = max(0.0, round(wall - named, 3)) if wall is not None else None
    return out
