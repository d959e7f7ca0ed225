"""Checkpoint snapshots on a GPU (issue 30): taking one makes no call that waits for the device (torch's sync debug
mode raises on any), the copy to pinned host memory runs on a side stream, and what reaches the host is exactly the
slot as it was when taken, whatever training did after; a pack snapshotting at every step resumes from a persisted one.

Skipped where there is no CUDA device (tests/worker/test_snapshots.py covers the same on the CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.factories import TINY, Persisted, make_spec
from worker.engine import PackCallbacks, PackConfig, PackEngine, load_base_model, restore_base_model, train_pack
from worker.engine import checkpoint as checkpoints
from worker.engine.validation import evaluate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
LAYERS = ["all-linear", "lm_head"]


def _host(engine: PackEngine, slot: int) -> dict[str, torch.Tensor]:
    """The slot's adapter and moments as the checkpoint names them, read to the host the plain (waiting) way."""
    store, optimizer, out = engine.store, engine.optimizer, {}
    for kind, matrix in (("adapter", store.weights), ("exp_avg", optimizer.exp_avg),
                         ("exp_avg_sq", optimizer.exp_avg_sq)):
        for path, (a, b) in store.read(matrix, slot).items():
            out[f"{kind}/{path}/A"], out[f"{kind}/{path}/B"] = a.cpu(), b.cpu()
    return out


def test_a_snapshot_on_a_gpu_waits_for_nothing_and_holds_the_slot_as_taken(model_cache: Path, tmp_path: Path) -> None:
    model, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CUDA)
    spec = make_spec("g", target_modules=LAYERS, lora_rank=8, max_steps=30)
    with PackEngine(model, tokenizer, capacity=2, max_rank=8, target_modules=LAYERS) as engine:
        slot = engine.admit(spec)
        for _ in range(3):
            engine.step()
        evaluate(engine, slot)
        engine.step()
        want = _host(engine, slot)
        torch.cuda.set_sync_debug_mode("error")
        try:
            snapshot = checkpoints.snapshot_slot(slot=slot, state=engine.state(slot), store=engine.store,
                                                 optimizer=engine.optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for _ in range(3):  # the next steps change the slot while its copy may still be under way
            engine.step()
        got = snapshot.host_tensors()
        assert {k for k in got if not k.startswith(("best/", "sampler/"))} == want.keys()
        for key, tensor in want.items():
            assert got[key].device.type == "cpu" and got[key].is_contiguous() and torch.equal(got[key], tensor), key
        assert any(not torch.equal(a.cpu(), want[f"adapter/{p}/A"])
                   for p, (a, _) in engine.store.read(engine.store.weights, slot).items())
        directory = snapshot.write(tmp_path / "g")
    with PackEngine(model, tokenizer, capacity=2, max_rank=8, target_modules=LAYERS) as engine:
        engine.admit(make_spec("other", seed=4))
        slot = engine.admit(spec, resume=directory)
        assert engine.state(slot).steps_done == 4
        resumed = _host(engine, slot)
        assert all(torch.equal(resumed[key], tensor) for key, tensor in want.items())
    restore_base_model(model)


def test_a_pack_on_a_gpu_snapshotting_every_step_resumes_from_a_persisted_checkpoint(
        model_cache: Path, tmp_path: Path) -> None:
    model, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CUDA)
    persisted = Persisted(tmp_path / "kept")

    def on_point(trial_id: str, step: int, split: str, value: float) -> None:
        if (step, split) == (6, "train"):
            persisted.wait(trial_id, 5)

    specs = [make_spec("g1", max_steps=12), make_spec("g2", seed=3, lora_rank=2, max_steps=12)]
    straight = train_pack(
        model, tokenizer, specs,
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "straight", checkpoint_dir=tmp_path / "ckpt",
                   checkpoint_interval_s=0),
        PackCallbacks(on_point=on_point, on_checkpoint=persisted),
    )
    assert [o.status for o in straight] == ["completed", "completed"]
    resume = {t: tmp_path / "kept" / t / "5" for t in ("g1", "g2")}
    points: list[tuple[str, int, str, float]] = []
    resumed = train_pack(
        model, tokenizer, specs,
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "resumed"),
        PackCallbacks(on_point=lambda *p: points.append(p)),
        resume=resume,
    )
    assert [(o.status, o.steps_done) for o in resumed] == [("completed", 12), ("completed", 12)]
    assert [p[1] for p in points if p[0] == "g1" and p[2] == "train"] == list(range(6, 13))
    for before, after in zip(straight, resumed, strict=True):  # the same run within the GPU's rounding
        assert before.final_train_loss is not None and after.final_train_loss is not None
        assert after.final_train_loss == pytest.approx(before.final_train_loss, rel=1e-3)
    restore_base_model(model)
