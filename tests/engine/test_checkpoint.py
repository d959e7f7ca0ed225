"""Checkpoint and exact resume: a resumed pack continues the same loss curve bit for bit on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import Persisted, completion_rows, make_spec, pack_arguments
from worker.engine import PackCallbacks, PackConfig, TrialOutcome, TrialSpec, train_pack

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]
Point = tuple[str, int, str, float]


def _specs() -> list[TrialSpec]:
    return [
        make_spec("a", max_steps=8, eval_interval=3, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "lm_head"]),
        make_spec(
            "b", seed=2, batch_size=3, lora_rank=2, target_modules=["all-linear"], lr_schedule="cosine", warmup_steps=2,
            max_grad_norm=0.5, weight_decay=0.01, train_rows=completion_rows(4), val_rows=[], max_steps=8,
        ),
    ]


def _run(tiny: Tiny, out: Path, **kwargs: Any) -> tuple[list[TrialOutcome], list[Point]]:
    points: list[Point] = []
    config, callbacks, rest = pack_arguments(base_model_name="tiny", export_dir=out,
                                             on_point=lambda *p: points.append(p), **kwargs)
    outcomes = train_pack(*tiny, _specs(), config, callbacks, **rest)
    return outcomes, points


def test_a_resumed_pack_continues_bit_for_bit(tiny: Tiny, tmp_path: Path) -> None:
    persisted = Persisted(tmp_path / "kept")
    points: list[Point] = []

    def on_point(*point: Any) -> None:
        points.append(point)
        if point[1:3] == (5, "train"):  # each trial's step-4 snapshot is on disk before it goes on
            persisted.wait(point[0], 4)

    straight = train_pack(
        *tiny, _specs(),
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "straight", checkpoint_dir=tmp_path / "ckpt",
                   checkpoint_interval_s=0),
        PackCallbacks(on_point=on_point, on_checkpoint=persisted),
    )
    for steps in (persisted.steps["a"], persisted.steps["b"]):
        # Newest first, superseded ones dropped: increasing steps, never the last (the trial ended there).
        assert 4 in steps and steps == sorted(set(steps)) and steps[-1] < 8, steps
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["a", "b"]  # replaced in place, no temp dirs
    last = json.loads((tmp_path / "ckpt" / "a" / "slot.json").read_text())["steps_done"]
    assert last == persisted.steps["a"][-1]

    resumed, resumed_points = _run(
        tiny, tmp_path / "resumed", resume={"a": tmp_path / "kept" / "a" / "4", "b": tmp_path / "kept" / "b" / "4"}
    )
    assert resumed_points == [p for p in points if p[1] > 4]  # the same losses, exactly
    assert [p[:3] for p in resumed_points if p[0] == "a"][:2] == [("a", 5, "train"), ("a", 6, "train")]
    for before, after in zip(straight, resumed, strict=True):
        assert after.adapter_dir is not None and before.adapter_dir is not None
        assert (after.steps_done, after.best_val_loss, after.best_step, after.final_train_loss) == (
            before.steps_done, before.best_val_loss, before.best_step, before.final_train_loss
        )
        weights, again = load_file(str(before.adapter_dir / "adapter_model.safetensors")), load_file(
            str(after.adapter_dir / "adapter_model.safetensors")
        )
        assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)


def test_a_checkpoint_of_another_configuration_is_refused(tiny: Tiny, tmp_path: Path) -> None:
    persisted = Persisted()

    def on_point(trial_id: str, step: int, split: str, value: float) -> None:
        if (step, split) == (2, "train"):
            persisted.wait(trial_id, 1)  # a checkpoint of each trial is on disk

    train_pack(
        *tiny, _specs(),
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt",
                   checkpoint_interval_s=0),
        PackCallbacks(on_point=on_point, on_checkpoint=persisted),
    )
    other = make_spec("a", lora_rank=8)
    (outcome,) = train_pack(
        *tiny, [other],
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "x"),
        PackCallbacks(on_point=lambda *p: None),
        resume={"a": tmp_path / "ckpt" / "a"},
    )
    assert outcome.status == "failed" and outcome.error is not None
    assert "different configuration" in outcome.error and "lora_rank" in outcome.error
    (missing,) = train_pack(
        *tiny, [make_spec("a")],
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "x"),
        PackCallbacks(on_point=lambda *p: None),
        resume={"a": tmp_path / "nowhere"},
    )
    assert missing.status == "failed" and missing.error is not None and "FileNotFoundError" in missing.error
