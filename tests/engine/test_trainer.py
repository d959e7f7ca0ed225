"""train_pack: learning, pack == alone, early stop, failure isolation, best-val export, model reuse."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import (
    assert_rel_close,
    chat_rows,
    completion_rows,
    make_spec,
    pack_arguments,
    record_engines,
    token_loss_sum,
)
from worker.engine import PackCallbacks, PackConfig, StepStats, TrialOutcome, TrialSpec, adapter_logits, train_pack
from worker.engine.batch import PackedBatch
from worker.engine.data import collate, encode_rows
from worker.engine.lora import StackedLoraLinear
from worker.engine.passes import ModelPasses
from worker.engine.trainer import StopMode

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]
Point = tuple[str, int, str, float]

# Two deliberately different trials: targets, rank, alpha, dropout, batch size, schedule, data, seed.
TRIAL_A: dict[str, Any] = {
    "target_modules": ["q_proj", "v_proj", "lm_head"],
    "lora_dropout": 0.05,
    "max_steps": 16,
    "train_rows": chat_rows(4),
}
TRIAL_B: dict[str, Any] = {
    "target_modules": ["all-linear", "lm_head"],
    "learning_rate": 1e-2,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "lora_dropout": 0.1,
    "batch_size": 2,
    "lr_schedule": "cosine",
    "warmup_steps": 3,
    "weight_decay": 0.01,
    "seed": 7,
    "max_steps": 20,
    "train_rows": completion_rows(4),
    "val_rows": [],
}


def _run(tiny: Tiny, specs: list[TrialSpec], out: Path, **kwargs: Any) -> tuple[list[TrialOutcome], list[Point]]:
    points: list[Point] = []
    config, callbacks, rest = pack_arguments(
        base_model_name="tiny-random-llama",
        export_dir=out,
        on_point=lambda *p: points.append(p),
        **kwargs,
    )
    outcomes = train_pack(*tiny, specs, config, callbacks, **rest)
    return outcomes, points


def _curve(points: list[Point], trial_id: str, split: str) -> list[float]:
    return [loss for t, _, s, loss in points if t == trial_id and s == split]


def _weights(adapter_dir: Path | None) -> dict[str, torch.Tensor]:
    assert adapter_dir is not None
    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def test_pack_learns_and_each_trial_equals_training_alone(tiny: Tiny, tmp_path: Path) -> None:
    stats: list[StepStats] = []
    pack, points = _run(
        tiny, [make_spec("a", **TRIAL_A), make_spec("b", **TRIAL_B)], tmp_path / "pack", on_step=stats.append
    )
    assert [(o.trial_id, o.status, o.steps_done) for o in pack] == [("a", "completed", 16), ("b", "completed", 20)]
    assert [s.step for s in stats] == list(range(1, 21))
    assert [s.active_slots for s in stats] == [2] * 16 + [1] * 4

    for trial_id, steps in [("a", 16), ("b", 20)]:
        train = _curve(points, trial_id, "train")
        assert len(train) == steps
        assert sum(train[-3:]) / 3 < train[0] - 2.0, f"{trial_id} did not learn: {train}"
    # Pinned (tiny model, seed 1): the untrained loss is ~ln(259); trial a's val loss after 16 steps
    # (with its hashed dropout masks, kernels/dropout.py).
    assert _curve(points, "a", "train")[0] == pytest.approx(5.5603, abs=1e-3)
    assert pack[0].best_val_loss == pytest.approx(1.8754, abs=1e-3)
    assert [(s, split) for t, s, split, _ in points if t == "a" and split == "val"] == [
        (4, "val"),
        (8, "val"),
        (12, "val"),
        (16, "val"),
    ]
    assert _curve(points, "b", "val") == [] and pack[1].best_val_loss is None and pack[1].best_step == 20

    for spec_kwargs, in_pack in [(TRIAL_A, pack[0]), (TRIAL_B, pack[1])]:
        (alone,), alone_points = _run(tiny, [make_spec(in_pack.trial_id, **spec_kwargs)], tmp_path / "alone")
        packed, single = _weights(in_pack.adapter_dir), _weights(alone.adapter_dir)
        assert packed.keys() == single.keys()
        for key in packed:
            assert_rel_close(packed[key], single[key])
        torch.testing.assert_close(
            _curve(points, in_pack.trial_id, "train"),
            _curve(alone_points, alone.trial_id, "train"),
            rtol=1e-5,
            atol=1e-6,
        )
        assert (alone.best_step, alone.final_train_loss) == pytest.approx((in_pack.best_step, in_pack.final_train_loss))


def test_should_stop_drops_a_trial_at_once(tiny: Tiny, tmp_path: Path) -> None:
    points: list[Point] = []

    def stop_b_after_five() -> dict[str, StopMode]:
        return {"b": "drop"} if any(p[:3] == ("b", 5, "train") for p in points) else {}

    outcomes = train_pack(
        *tiny, [make_spec("a"), make_spec("b", seed=2)],
        PackConfig(base_model_name="tiny", export_dir=tmp_path),
        PackCallbacks(on_point=lambda *p: points.append(p), should_stop=stop_b_after_five),
    )
    a, b = outcomes
    assert (a.status, a.steps_done, a.adapter_dir) == ("completed", 12, tmp_path / "a")
    assert (b.status, b.steps_done, b.adapter_dir, b.error) == ("stopped", 5, None, None)
    assert b.best_step == 4 and b.final_train_loss == _curve(points, "b", "train")[-1]
    assert max(step for t, step, _, _ in points if t == "b") == 5
    assert not (tmp_path / "b").exists()


def test_failing_trials_do_not_take_down_the_pack(tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engines = record_engines(monkeypatch)
    real_forward_backward = ModelPasses.forward_backward

    def breaks_for_c(passes: ModelPasses, batch: PackedBatch) -> Any:
        engine = engines[-1]
        c = [slot for slot, state in enumerate(engine.slots) if state is not None and state.spec.trial_id == "c"]
        if c and c[0] in batch.n_targets and engine.state(c[0]).steps_done == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_forward_backward(passes, batch)

    monkeypatch.setattr(ModelPasses, "forward_backward", breaks_for_c)
    specs = [
        make_spec("bad-target", target_modules=["q_proj", "qkv_proj"]),
        make_spec("ok"),
        make_spec("c", seed=3),
        make_spec("bad-spec", lora_rank=0, lr_schedule="step"),
        make_spec("no-data", train_rows=[{"messages": [{"role": "user", "content": "hi"}]}]),
    ]
    bad_target, ok, c, bad_spec, no_data = _run(tiny, specs, tmp_path)[0]
    assert (ok.status, ok.steps_done) == ("completed", 12)
    assert (c.status, c.steps_done, c.adapter_dir) == ("failed", 3, None)
    assert c.error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert bad_target.status == "failed" and bad_target.steps_done == 0
    assert bad_target.error is not None and "'qkv_proj' matches no linear layer" in bad_target.error
    assert bad_spec.error is not None and "lora_rank 0 < 1" in bad_spec.error and "lr_schedule 'step'" in bad_spec.error
    assert no_data.error == "ValueError: no training row has a target token left after truncation"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]
    # The step that failed jointly was retried slot by slot: "ok" trained as it would have alone.
    monkeypatch.setattr(ModelPasses, "forward_backward", real_forward_backward)
    (alone,), _ = _run(tiny, [make_spec("ok")], tmp_path / "alone")
    packed, single = _weights(ok.adapter_dir), _weights(alone.adapter_dir)
    for key in packed:
        torch.testing.assert_close(packed[key], single[key], rtol=1e-5, atol=1e-6)


def test_nan_loss_is_reported_not_an_error(tiny: Tiny, tmp_path: Path) -> None:
    # An infinite learning rate turns the adapter into NaN after the first update.
    spec = make_spec("nan", learning_rate=float("inf"), max_steps=3, eval_interval=1)
    (outcome,), points = _run(tiny, [spec], tmp_path)
    train, val = _curve(points, "nan", "train"), _curve(points, "nan", "val")
    assert math.isfinite(train[0]) and all(math.isnan(loss) for loss in train[1:] + val)
    assert (outcome.status, outcome.steps_done, outcome.error) == ("completed", 3, None)
    # A NaN validation loss never counts as the best: none is best, so the final adapter is exported.
    assert (outcome.best_val_loss, outcome.best_step) == (None, 3)
    assert outcome.adapter_dir == tmp_path / "nan"


def test_best_validation_adapter_is_exported(tiny: Tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny
    # Overfit: learn counting rows hard, validate on unrelated text, so validation gets worse later.
    val_rows = [{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "kenobi!"}]}]
    spec = make_spec(
        "overfit",
        learning_rate=5e-2,
        max_steps=30,
        eval_interval=2,
        train_rows=chat_rows(4),
        target_modules=["all-linear", "lm_head"],
        val_rows=val_rows,
    )
    (outcome,), points = _run(tiny, [spec], tmp_path)
    val = [(step, loss) for t, step, split, loss in points if split == "val"]
    best_step, best_loss = min(val, key=lambda v: v[1])
    assert (outcome.best_step, outcome.best_val_loss) == (best_step, best_loss)
    assert best_step < 30, "setup no longer overfits; the test would not tell best from last"

    # The exported adapter reproduces the best validation loss, not the final one.
    assert outcome.adapter_dir is not None
    total, n_targets = 0.0, 0
    examples = encode_rows(val_rows, tokenizer, 64)
    for batch in [collate(examples[i : i + 4], 256) for i in range(0, len(examples), 4)]:
        logits = adapter_logits(model, outcome.adapter_dir, batch.input_ids, batch.attention_mask)
        total += token_loss_sum(logits, batch.labels).item()
        n_targets += int((batch.labels[:, 1:] != -100).sum())
    assert total / n_targets == pytest.approx(best_loss, rel=1e-5)
    assert abs(total / n_targets - val[-1][1]) > 1e-3


def test_model_is_reusable_after_a_pack(tiny: Tiny, tmp_path: Path) -> None:
    model, _ = tiny
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    before = model(input_ids=ids).logits
    first, _ = _run(tiny, [make_spec("x", max_steps=3)], tmp_path / "1")
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules())
    assert not any(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    second, _ = _run(tiny, [make_spec("x", max_steps=3)], tmp_path / "2")
    assert first[0].final_train_loss == second[0].final_train_loss  # a second pack starts from scratch


def test_duplicate_trial_ids_are_refused(tiny: Tiny, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="duplicate trial ids"):
        _run(tiny, [make_spec("same"), make_spec("same")], tmp_path)


def test_a_back_filled_trial_joins_a_free_slot_mid_pack_and_trains_as_alone(tiny: Tiny, tmp_path: Path) -> None:
    """c and d arrive while a and b train (after a's 6th step) in a pack with room for three: c takes the
    free slot at once; d waits for the slot a frees and is then refused (its rank is above the pack's
    padding). Each outcome is passed on the moment its trial ends."""
    points: list[Point] = []
    waiting = [make_spec("c", max_steps=6, seed=3), make_spec("d", lora_rank=64, seed=4)]
    offered: list[int] = []
    admitted: list[tuple[str, str | None]] = []
    ended: list[tuple[str, int]] = []

    def admissions(free: int) -> list[tuple[TrialSpec, Path | None]]:
        if not any(p[:3] == ("a", 6, "train") for p in points) or not waiting:
            return []
        offered.append(free)
        taken, waiting[:] = waiting[:free], waiting[free:]
        return [(spec, None) for spec in taken]

    outcomes = train_pack(
        *tiny, [make_spec("a", max_steps=8), make_spec("b", max_steps=16, seed=2)],
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "pack", capacity=3, max_rank=8),
        PackCallbacks(on_point=lambda *p: points.append(p), admissions=admissions,
                      on_admitted=lambda t, reason: admitted.append((t, reason)),
                      on_outcome=lambda o: ended.append((o.trial_id, len(points)))),
    )  # fmt: skip
    assert offered == [1, 1]  # one slot free after c joined; then a finished and freed another for d
    assert [t for t, _ in admitted] == ["c", "d"]
    assert admitted[0][1] is None and admitted[1][1] is not None and "rank 64" in admitted[1][1]
    assert [(o.trial_id, o.status, o.steps_done) for o in outcomes] == [
        ("a", "completed", 8), ("b", "completed", 16), ("c", "completed", 6)]
    # Each outcome went out as its trial ended, before the later points of the trials still training.
    assert [t for t, _ in ended] == ["a", "c", "b"] and ended[0][1] < ended[1][1] < ended[2][1]
    # c joined at a's 6th step and trains exactly as it would alone.
    (alone,), alone_points = _run(tiny, [make_spec("c", max_steps=6, seed=3)], tmp_path / "alone")
    torch.testing.assert_close(_curve(points, "c", "train"), _curve(alone_points, "c", "train"), rtol=1e-5, atol=1e-6)
    packed, single = _weights(outcomes[2].adapter_dir), _weights(alone.adapter_dir)
    for key in packed:
        assert_rel_close(packed[key], single[key])


def test_stop_modes_export_the_best_adapter_or_pause_to_resume_exactly(tiny: Tiny, tmp_path: Path) -> None:
    """"export" ends a trial with its best-validation adapter; "pause" checkpoints it at the step it left,
    and admitted again from that checkpoint it goes on as if it had never left."""
    points: list[Point] = []
    checkpoints: dict[str, tuple[int, Path]] = {}
    requested: dict[str, StopMode] = {}
    back: list[tuple[TrialSpec, Path | None]] = []

    def stops() -> dict[str, StopMode]:
        if any(p[:3] == ("a", 4, "val") for p in points):
            requested["a"] = "export"
        if any(p[:3] == ("b", 6, "train") for p in points) and "b" not in checkpoints:
            requested["b"] = "pause"
        return dict(requested)

    def admissions(free: int) -> list[tuple[TrialSpec, Path | None]]:
        if "b" in checkpoints and not back and any(p[:3] == ("c", 9, "train") for p in points):
            back.append((make_spec("b", max_steps=12, seed=2), checkpoints["b"][1]))
            requested.pop("b")
            return back[:free]
        return []

    outcomes = train_pack(
        *tiny, [make_spec("a", max_steps=12), make_spec("b", max_steps=12, seed=2), make_spec("c", seed=3)],
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "pack",
                   checkpoint_dir=tmp_path / "ckpt"),  # pauses only
        PackCallbacks(on_point=lambda *p: points.append(p), should_stop=stops, admissions=admissions,
                      on_checkpoint=lambda t, step, path: checkpoints.setdefault(t, (step, path))),
    )  # fmt: skip
    got = [(o.trial_id, o.status, o.steps_done) for o in outcomes]
    assert got == [("a", "stopped", 4), ("b", "paused", 6), ("b", "completed", 12), ("c", "completed", 12)]
    a = outcomes[0]
    assert a.adapter_dir is not None and a.best_step == 4 and (a.adapter_dir / "adapter_model.safetensors").exists()
    assert outcomes[1].adapter_dir is None and checkpoints["b"][0] == 6
    (alone,), alone_points = _run(tiny, [make_spec("b", max_steps=12, seed=2)], tmp_path / "alone")
    torch.testing.assert_close(_curve(points, "b", "train"), _curve(alone_points, "b", "train"), rtol=1e-5, atol=1e-6)
    packed, single = _weights(outcomes[2].adapter_dir), _weights(alone.adapter_dir)
    for key in packed:
        assert_rel_close(packed[key], single[key])


def test_files_and_their_callbacks_run_off_the_training_thread_in_order(tiny: Tiny, tmp_path: Path) -> None:
    """Checkpoints and exports are written on the pack's writer thread; each trial's checkpoint reports come
    before its end, its adapter is on disk when its end is reported, and the pack's phases are timed."""
    import threading

    from tests.engine.factories import Persisted
    from worker.engine.trainer import PackTimings

    model, tokenizer = tiny
    specs = [make_spec("w1", max_steps=8, eval_interval=4), make_spec("w2", max_steps=6, eval_interval=3, seed=4)]
    events: list[tuple[str, str, int | str, str]] = []
    main = threading.current_thread().name
    persisted = Persisted()

    def on_checkpoint(trial_id: str, step: int, path: Path) -> None:
        assert (path / "slot.safetensors").is_file()
        events.append(("checkpoint", trial_id, step, threading.current_thread().name))
        persisted(trial_id, step, path)

    def on_outcome(outcome: TrialOutcome) -> None:
        assert outcome.adapter_dir is not None and (outcome.adapter_dir / "adapter_model.safetensors").is_file()
        events.append(("outcome", outcome.trial_id, outcome.status, threading.current_thread().name))

    def on_point(trial_id: str, step: int, split: str, value: float) -> None:
        if (step, split) == (3, "train"):
            persisted.wait(trial_id, 2)  # each trial has a checkpoint before its end

    timings = PackTimings()
    outcomes = train_pack(
        model, tokenizer, specs,
        PackConfig(base_model_name="tiny", export_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt",
                   checkpoint_interval_s=0),
        PackCallbacks(on_point=on_point, on_checkpoint=on_checkpoint, on_outcome=on_outcome),
        timings=timings,
    )  # fmt: skip
    assert [o.status for o in outcomes] == ["completed", "completed"]
    assert {thread for *_, thread in events} != {main}  # not on the training thread
    for trial_id, last in (("w1", 8), ("w2", 6)):
        mine = [(kind, what) for kind, tid, what, _ in events if tid == trial_id]
        steps = [int(what) for kind, what in mine[:-1]]
        assert mine[-1] == ("outcome", "completed") and 2 in steps, mine
        assert steps == sorted(set(steps)) and steps[-1] < last, mine  # newest first: never an older one after
    summary = timings.summary()
    assert timings.steps_s > 0 and timings.validation_s > 0 and timings.snapshot_s > 0 and timings.export_s > 0
    assert timings.persist_s > 0 and timings.snapshots.offered >= timings.snapshots.done >= 2
    parts = timings.steps_s + timings.validation_s + timings.snapshot_s + timings.export_s + timings.idle_s
    assert parts <= timings.wall_s and summary["outside_steps_frac"] == round(1 - timings.steps_s / timings.wall_s, 4)
    assert "snapshots" not in summary


def test_a_callback_that_raises_on_the_writer_thread_stops_the_pack(tiny: Tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny

    def on_checkpoint(trial_id: str, step: int, path: Path) -> None:
        raise RuntimeError("the artifact store is full")

    steps: list[int] = []
    with pytest.raises(RuntimeError, match="store is full"):
        train_pack(
            model, tokenizer, [make_spec("x", max_steps=100_000)],
            PackConfig(base_model_name="tiny", export_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt",
                       checkpoint_interval_s=0),
            PackCallbacks(on_point=lambda t, step, split, v: steps.append(step), on_checkpoint=on_checkpoint),
        )  # fmt: skip
    assert max(steps) < 100_000  # the pack stopped at the failure, not at its end
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules())  # the model is bare again


def test_a_validation_that_breaks_fails_only_its_trial(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared validation forward raises: the due slots are validated one by one, the one that breaks
    fails, the others keep their validation points and complete."""
    engines = record_engines(monkeypatch)
    real_loss_sums = ModelPasses.loss_sums

    def breaks_for_v(passes: ModelPasses, batch: PackedBatch, *, training: bool) -> Any:
        engine = engines[-1]
        v = [slot for slot, state in enumerate(engine.slots) if state is not None and state.spec.trial_id == "v"]
        if not training and v and v[0] in batch.n_targets:
            raise RuntimeError("CUDA out of memory in validation")
        return real_loss_sums(passes, batch, training=training)

    monkeypatch.setattr(ModelPasses, "loss_sums", breaks_for_v)
    (fine, v), points = _run(tiny, [make_spec("fine"), make_spec("v", seed=5)], tmp_path)
    assert (fine.status, fine.steps_done) == ("completed", 12)
    assert (v.status, v.steps_done, v.error) == ("failed", 4, "RuntimeError: CUDA out of memory in validation")
    assert [step for trial, step, split, _ in points if trial == "fine" and split == "val"] == [4, 8, 12]
    assert not [p for p in points if p[0] == "v" and p[2] == "val"]


def test_spare_slots_are_allocated_only_where_memory_allows() -> None:
    """A pack's spare slots (room for back-fills) take at most a quarter of the free device memory."""
    from worker.engine.store import slot_bytes
    from worker.engine.trainer import SPARE_SLOTS_MEMORY_FRACTION, spare_slots

    # Llama-3.1-8B's seven projections in 32 layers at rank 64, bf16 compute: ~2.7 GB a slot.
    layer = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    per_slot = slot_bytes(layer * 32, 64, torch.bfloat16)
    assert per_slot == 64 * 32 * sum(a + b for a, b in layer) * (4 + 2 + 2 + 4 + 4)
    free = 40 * 2**30  # what an 80 GB GPU has left with the 8B model and 8 slots' stores loaded
    assert spare_slots(per_slot, free, wanted=24) == int(free * SPARE_SLOTS_MEMORY_FRACTION) // per_slot == 4
    assert spare_slots(per_slot, None, wanted=24) == 24  # the CPU: no limit
    assert spare_slots(per_slot, 2**20, wanted=24) == 0
    assert slot_bytes([(8, 16)], 4, torch.float32) == 4 * 24 * (4 + 4 + 4 + 4)  # fp32: no compute copy
