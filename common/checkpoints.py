"""Which of a trial's adapter checkpoints it keeps, and what each one is (pure: no I/O).

A trial training with checkpoints (worker/engine/trainer.py) exports its adapter at each epoch's end and at its last
step, and with them its best adapter (at the best's own step) when that is older and not exported yet. Of those it keeps
the best (the lowest validation loss), the last, and the newest ``epochs_kept`` epoch ends (None: every one); the
worker that writes a new one drops the rest (worker/pack_runner.py), and the API lists what is kept with these
kinds (api/services/checkpoints.py).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

BEST, LAST, EPOCH = "best", "last", "epoch"


@dataclass(frozen=True)
class Saved:
    """One stored checkpoint: its step, whether it ends an epoch, and its validation loss (None: not validated)."""

    step: int
    epoch_end: bool
    val_loss: float | None


def best_step(saved: Collection[Saved]) -> int | None:
    """The step of the lowest finite validation loss (the earliest of equals, as the trainer keeps its best)."""
    finite = [s for s in saved if s.val_loss is not None and math.isfinite(s.val_loss)]
    if not finite:
        return None
    return min(finite, key=lambda s: (s.val_loss, s.step)).step


def kept(saved: Collection[Saved], *, epochs_kept: int | None, best: int | None = None) -> set[int]:
    """The steps to keep: the best (``best`` when the trainer says which, else the lowest loss here), the last, and
    the newest ``epochs_kept`` epoch ends (None: all)."""
    if not saved:
        return set()
    keep = {max(s.step for s in saved)}
    best = best if best is not None and any(s.step == best for s in saved) else best_step(saved)
    if best is not None:
        keep.add(best)
    ends = sorted((s.step for s in saved if s.epoch_end), reverse=True)
    keep.update(ends if epochs_kept is None else ends[:epochs_kept])
    return keep


def kinds(saved: Collection[Saved]) -> dict[int, list[str]]:
    """What each kept checkpoint is, by step: "best", "last" (the newest: the trial's last step once it has ended)
    and "epoch"."""
    if not saved:
        return {}
    best, last = best_step(saved), max(s.step for s in saved)
    out: dict[int, list[str]] = {}
    for s in sorted(saved, key=lambda s: s.step):
        out[s.step] = [k for k, yes in ((BEST, s.step == best), (LAST, s.step == last),
                                        (EPOCH, s.epoch_end)) if yes]
    return out
