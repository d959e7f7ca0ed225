"""Adapter checkpoints (``TrialSpec.adapter_checkpoints``): exported at each epoch's end and the last step, with the
best adapter (when older and not exported yet) at its own step, each the adapter as it was at its step, handed over
before the trial's outcome; validated only where an evaluation falls."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import chat_rows, make_spec, score
from worker.engine import AdapterCheckpoint, Evaluation, PackCallbacks, PackConfig, read_peft_adapter, train_pack
from worker.engine.slots import MAX_EPOCH_CHECKPOINTS

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def _train(tiny: Tiny, out: Path, **overrides: object) -> tuple[list[AdapterCheckpoint], list[tuple[int, str]],
                                                                 list[str]]:
    """Trains one trial (8 rows at 4 a step: 2 steps an epoch) for 7 steps; its checkpoints (each kept in
    ``out/kept/``), its validation and metric points, and the order of checkpoint and outcome callbacks."""
    saved: list[AdapterCheckpoint] = []
    points: list[tuple[int, str]] = []
    order: list[str] = []

    def keep(checkpoint: AdapterCheckpoint) -> None:
        saved.append(checkpoint)
        order.append(f"checkpoint {checkpoint.step}")
        checkpoint.files.write_dir(out / "kept" / str(checkpoint.step))

    spec = make_spec("t1", max_steps=7, eval_interval=3, adapter_checkpoints=True, **overrides)
    train_pack(*tiny, [spec], PackConfig(base_model_name="tiny-random-llama", export_dir=out / "export"),
               PackCallbacks(on_point=lambda trial_id, step, split, loss: points.append((step, split)),
                             on_adapter_checkpoint=keep, on_outcome=lambda o: order.append("outcome"),
                             score=score))
    return saved, points, order


def _tensors(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return read_peft_adapter(directory)[1]


def _assert_same(a: Path, b: Path) -> None:
    left, right = _tensors(a), _tensors(b)
    assert left.keys() == right.keys()
    for path in left:
        torch.testing.assert_close(left[path], right[path], rtol=0, atol=0)


def _peaking_early(tiny: Tiny, out: Path) -> tuple[float, list[AdapterCheckpoint], list[tuple[int, str]], list[str]]:
    """A run whose best validation is its first (step 3 of 3, 6, 7), with the learning rate it took: a learning rate
    this high peaks early, but where exactly depends on the tiny model's random weights (transformers' initialisation
    changed between releases), so the first of a few that does is taken; none doing so fails the test."""
    for learning_rate in (3.0, 10.0, 30.0):
        run = out / str(learning_rate)
        saved, points, order = _train(tiny, run, learning_rate=learning_rate,
                                      evaluation=Evaluation(metric="contains", max_new_tokens=4))
        losses = {c.step: c.val_loss for c in saved if c.val_loss is not None}
        if min(losses, key=lambda step: losses[step]) == 3:
            return learning_rate, saved, points, order
    raise AssertionError("no learning rate made the trial's first validation its best")


def test_checkpoints_at_epoch_ends_the_last_step_and_the_best(tiny: Tiny, tmp_path: Path) -> None:
    learning_rate, saved, points, order = _peaking_early(tiny, tmp_path)
    tmp_path = tmp_path / str(learning_rate)
    validated = [step for step, split in points if split == "val"]
    assert validated == [3, 6, 7]  # every 3 steps and the last: epoch ends (2, 4, 6) add none
    # The best is step 3's, exported (once) at the next epoch's end, before it.
    assert [(c.step, c.ends_epoch(c.step), c.val_loss is not None) for c in saved] == [
        (2, True, False), (3, False, True), (4, True, False), (6, True, True), (7, False, True)]
    assert all(c.epoch == c.step / 2 for c in saved)
    assert saved[-1].best_step == 3 and min((c for c in saved if c.val_loss is not None),
                                            key=lambda c: c.val_loss or 0.0).step == 3
    assert order[-1] == "outcome" and len(order) == len(saved) + 1  # every checkpoint before the outcome
    assert (7, "metric") in points  # the best adapter was installed to score: the last checkpoint is still step 7's

    # The last checkpoint holds the weights of step 7, not the best ones the outcome exports: the same trial without
    # validation (which changes nothing in its training) ends with exactly them.
    bare_saved, _, _ = _train(tiny, tmp_path / "bare", val_rows=[], learning_rate=learning_rate)
    assert [c.step for c in bare_saved] == [2, 4, 6, 7] and all(c.val_loss is None for c in bare_saved)
    _assert_same(tmp_path / "kept" / "7", tmp_path / "bare" / "export" / "t1")
    _assert_same(tmp_path / "kept" / "3", tmp_path / "export" / "t1")  # the best checkpoint is the trial's adapter
    assert not torch.equal(_tensors(tmp_path / "kept" / "7")["model.layers.0.self_attn.q_proj"][1],
                           _tensors(tmp_path / "export" / "t1")["model.layers.0.self_attn.q_proj"][1])


def test_without_checkpoints_nothing_is_exported(tiny: Tiny, tmp_path: Path) -> None:
    saved: list[AdapterCheckpoint] = []
    points: list[tuple[int, str]] = []
    spec = make_spec("t1", max_steps=7, eval_interval=3)
    train_pack(*tiny, [spec], PackConfig(base_model_name="tiny-random-llama", export_dir=tmp_path),
               PackCallbacks(on_point=lambda trial_id, step, split, loss: points.append((step, split)),
                             on_adapter_checkpoint=saved.append))
    assert saved == []
    assert [step for step, split in points if split == "val"] == [3, 6, 7]


def test_a_trial_of_many_tiny_epochs_exports_at_most_max_epoch_checkpoints(tiny: Tiny, tmp_path: Path) -> None:
    """Four rows at four a step: an epoch a step, 50 of them. Every third epoch's end gets a checkpoint (ceil(50 /
    20)), and the last step: 17 exports, not 50."""
    saved: list[AdapterCheckpoint] = []
    spec = make_spec("t1", max_steps=50, eval_interval=25, adapter_checkpoints=True, train_rows=chat_rows(4))
    train_pack(*tiny, [spec], PackConfig(base_model_name="tiny-random-llama", export_dir=tmp_path),
               PackCallbacks(on_point=lambda *a: None, on_adapter_checkpoint=saved.append))
    steps = [c.step for c in saved if c.step not in (25,)]  # the best at an evaluation may join them
    assert [s for s in steps if s != 50] == list(range(3, 50, 3)) and steps[-1] == 50
    assert len(saved) <= MAX_EPOCH_CHECKPOINTS + 2
