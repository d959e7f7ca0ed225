"""Checkpoint and exact resume: a resumed pack continues the same loss curve bit for bit on CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import completion_rows, make_spec
from worker.engine import TrialOutcome, TrialSpec, train_pack

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
    outcomes = train_pack(*tiny, _specs(), base_model_name="tiny", export_dir=out,
                          on_point=lambda *p: points.append(p), **kwargs)
    return outcomes, points


def test_a_resumed_pack_continues_bit_for_bit(tiny: Tiny, tmp_path: Path) -> None:
    saved: list[tuple[str, int]] = []

    def keep_step_4(trial_id: str, step: int, path: Path) -> None:
        saved.append((trial_id, step))
        if step == 4:
            shutil.copytree(path, tmp_path / "at-4" / trial_id)

    straight, points = _run(tiny, tmp_path / "straight", checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=2,
                            on_checkpoint=keep_step_4)
    assert saved == [(t, s) for s in (2, 4, 6, 8) for t in ("a", "b")]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["a", "b"]  # replaced in place, no temp dirs
    assert json.loads((tmp_path / "ckpt" / "a" / "slot.json").read_text())["steps_done"] == 8

    resumed, resumed_points = _run(
        tiny, tmp_path / "resumed", resume={"a": tmp_path / "at-4" / "a", "b": tmp_path / "at-4" / "b"}
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
    _run(tiny, tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=4)
    other = make_spec("a", lora_rank=8)
    (outcome,) = train_pack(*tiny, [other], base_model_name="tiny", export_dir=tmp_path / "x",
                            on_point=lambda *p: None, resume={"a": tmp_path / "ckpt" / "a"})
    assert outcome.status == "failed" and outcome.error is not None
    assert "different configuration" in outcome.error and "lora_rank" in outcome.error
    (missing,) = train_pack(*tiny, [make_spec("a")], base_model_name="tiny", export_dir=tmp_path / "x",
                            on_point=lambda *p: None, resume={"a": tmp_path / "nowhere"})
    assert missing.status == "failed" and missing.error is not None and "FileNotFoundError" in missing.error
