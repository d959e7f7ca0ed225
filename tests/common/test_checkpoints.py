"""Which adapter checkpoints a trial keeps and what each one is (common/checkpoints.py)."""

from __future__ import annotations

from common.checkpoints import Saved, best_step, kept, kinds


def _epochs(*steps: int, every: int = 10, losses: dict[int, float] | None = None) -> list[Saved]:
    return [Saved(s, s % every == 0, (losses or {}).get(s)) for s in steps]


def test_keeps_the_best_the_last_and_every_epoch_by_default() -> None:
    saved = _epochs(3, 10, 14, 20, 30, 35, losses={3: 2.0, 10: 1.5, 14: 1.2, 20: 1.3, 30: 1.4, 35: 1.6})
    assert kept(saved, epochs_kept=None) == {10, 14, 20, 30, 35}  # 3 was a best once, no longer
    assert kept(saved, epochs_kept=1) == {14, 30, 35}
    assert kept(saved, epochs_kept=0) == {14, 35}


def test_the_trainers_best_wins_over_the_losses_it_was_told() -> None:
    saved = _epochs(10, 20, 25, 30)  # not validated: no loss to rank by
    assert kept(saved, epochs_kept=0) == {30}
    assert kept(saved, epochs_kept=0, best=25) == {25, 30}
    assert kept(saved, epochs_kept=0, best=99) == {30}  # a best whose checkpoint is not stored keeps nothing


def test_best_step_ignores_what_is_not_finite_and_takes_the_earliest_of_equals() -> None:
    saved = _epochs(1, 2, 3, 4, losses={1: float("nan"), 2: 0.5, 3: 0.5, 4: float("inf")})
    assert best_step(saved) == 2
    assert best_step(_epochs(1, losses={1: float("nan")})) is None
    assert kept([], epochs_kept=None) == set() and kinds([]) == {}


def test_kinds() -> None:
    saved = _epochs(5, 10, 20, 25, losses={5: 1.0, 10: 0.8, 20: 0.9, 25: 0.95})
    assert kinds(saved) == {5: [], 10: ["best", "epoch"], 20: ["epoch"], 25: ["last"]}
    assert kinds(_epochs(10, 20, losses={10: 2.0, 20: 1.0}))[20] == ["best", "last", "epoch"]
