"""Learning-rate schedule values, pinned by hand."""

from __future__ import annotations

import pytest

from worker.engine import lr_at


def _curve(schedule: str, max_steps: int, warmup_steps: int) -> list[float]:
    return [
        lr_at(s, base_lr=1.0, max_steps=max_steps, warmup_steps=warmup_steps, schedule=schedule)
        for s in range(max_steps)
    ]


def test_constant_with_and_without_warmup() -> None:
    assert _curve("constant", 4, 0) == [1.0, 1.0, 1.0, 1.0]
    assert _curve("constant", 5, 3) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_linear_decay_after_warmup() -> None:
    # warm-up (s+1)/(w+1) for s < 2, then 1 - (s-2)/(6-2)
    assert _curve("linear", 6, 2) == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])
    assert _curve("linear", 4, 0) == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_cosine_decay_after_warmup() -> None:
    # 0.5 * (1 + cos(pi * (s-1)/4)) after one warm-up step
    assert _curve("cosine", 5, 1) == pytest.approx([0.5, 1.0, 0.8535534, 0.5, 0.1464466])
    assert lr_at(0, base_lr=3e-4, max_steps=10, schedule="cosine") == pytest.approx(3e-4)


def test_unknown_schedule_raises() -> None:
    with pytest.raises(ValueError, match="unknown lr_schedule 'step'"):
        lr_at(0, base_lr=1.0, max_steps=1, schedule="step")
