"""Learning-rate schedules as one pure function (nanoGPT's ``get_lr`` shape)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, *, base_lr: float, max_steps: int, warmup_steps: int = 0, schedule: str = "constant") -> float:
    """Learning rate of optimizer step ``step`` (0-based, ``0 <= step < max_steps``).

    1) warm-up: ``base_lr * (step + 1) / (warmup_steps + 1)`` for the first ``warmup_steps`` steps
       (``+1`` so the first step already learns, as nanoGPT; Hugging Face's starts at lr 0);
    2) ``"constant"``: ``base_lr``;
    3) ``"linear"`` / ``"cosine"``: decay from ``base_lr`` towards 0 over the remaining steps; the last
       step keeps a small positive lr rather than wasting a step at 0.

    Raises:
        ValueError: an unknown schedule.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}, want one of {LR_SCHEDULES}")
    if step < warmup_steps:
        return base_lr * (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return base_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    assert 0.0 <= progress <= 1.0, f"step {step} outside 0..{max_steps - 1}"
    if schedule == "linear":
        return base_lr * (1.0 - progress)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
