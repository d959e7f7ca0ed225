"""The kept engine (worker/engine/keeper.py): a second pack of the same model and shape takes the first pack's
engine and trains exactly as a fresh engine would; another shape, or a pack that raised, gets a new one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import chat_rows, make_spec, pack_arguments
from worker.engine import TrialOutcome, TrialSpec, train_pack
from worker.engine.keeper import EngineKeeper
from worker.engine.lora import StackedLoraLinear
from worker.engine.trainer import StopMode

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]
LAYERS = ["q_proj", "v_proj"]


def _specs(prefix: str) -> list[TrialSpec]:
    return [make_spec(f"{prefix}{i}", target_modules=LAYERS, seed=i, max_steps=6, learning_rate=1e-2,
                      train_rows=chat_rows(4), val_rows=chat_rows(2), eval_interval=3) for i in range(2)]


def _pack(tiny: Tiny, specs: list[TrialSpec], out: Path, keeper: EngineKeeper | None,
          **kwargs: object) -> list[TrialOutcome]:  # fmt: skip
    config, callbacks, rest = pack_arguments(base_model_name="tiny", export_dir=out, on_point=lambda *p: None,
                                             **kwargs)
    return train_pack(*tiny, specs, config, callbacks, keeper=keeper, **rest)


def _adapters(outcomes: list[TrialOutcome]) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(o.adapter_dir / "adapter_model.safetensors")) for o in outcomes if o.adapter_dir]


def _wrapped(model: PreTrainedModel) -> bool:
    return any(isinstance(m, StackedLoraLinear) for m in model.modules())


def test_a_second_pack_takes_the_kept_engine_and_trains_as_a_fresh_one(tiny: Tiny, tmp_path: Path) -> None:
    keeper = EngineKeeper()
    _pack(tiny, _specs("a"), tmp_path / "first", keeper)
    assert keeper.holds(tiny[0]) and _wrapped(tiny[0])  # kept: the layers stay wrapped between packs
    second = _pack(tiny, _specs("b"), tmp_path / "second", keeper)
    assert keeper.reuses == 1
    keeper.drop()
    assert not _wrapped(tiny[0])  # dropped: the bare base model again
    fresh = _pack(tiny, _specs("b"), tmp_path / "fresh", None)
    assert [o.status for o in second] == ["completed", "completed"]
    assert [(o.final_train_loss, o.best_val_loss) for o in second] == [(o.final_train_loss, o.best_val_loss)
                                                                        for o in fresh]
    for kept, new in zip(_adapters(second), _adapters(fresh), strict=True):
        assert kept.keys() == new.keys()
        for key in kept:
            torch.testing.assert_close(kept[key], new[key], rtol=0, atol=0)


def test_another_shape_gets_a_new_engine(tiny: Tiny, tmp_path: Path) -> None:
    keeper = EngineKeeper()
    _pack(tiny, _specs("a"), tmp_path / "first", keeper)
    other = [make_spec("c", target_modules=["all-linear"], lora_rank=8, max_steps=2, train_rows=chat_rows(2))]
    outcomes = _pack(tiny, other, tmp_path / "second", keeper)
    assert keeper.reuses == 0 and outcomes[0].status == "completed"
    # More trials than the kept engine has slots: a new engine too.
    _pack(tiny, _specs("d") + [make_spec("d9", target_modules=LAYERS, max_steps=2, train_rows=chat_rows(2))],
          tmp_path / "third", keeper)
    assert keeper.reuses == 0
    keeper.drop()
    assert not _wrapped(tiny[0])


def test_a_pack_whose_training_raises_closes_its_engine_instead_of_keeping_it(tiny: Tiny, tmp_path: Path) -> None:
    keeper = EngineKeeper()
    _pack(tiny, _specs("a"), tmp_path / "first", keeper)

    polls = iter(range(3))

    def inbox_breaks() -> dict[str, StopMode]:  # called on the training thread before each step: the third raises
        if next(polls, None) is None:
            raise RuntimeError("the inbox is gone")
        return {}

    with pytest.raises(RuntimeError, match="the inbox is gone"):
        _pack(tiny, _specs("b"), tmp_path / "second", keeper, should_stop=inbox_breaks)
    assert keeper.reuses == 1 and not keeper.holds(tiny[0]) and not _wrapped(tiny[0])


def test_a_smaller_pack_of_fewer_layers_and_a_lower_rank_takes_the_kept_engine(tiny: Tiny, tmp_path: Path) -> None:
    """An early-exit task's later packs hold fewer trials over the same or fewer layers at a rank up to the first
    pack's: they fit the kept engine (its slots padded to its rank) and train as in a new engine of their own."""
    keeper = EngineKeeper()
    wide = [make_spec(f"w{i}", target_modules=["q_proj", "v_proj", "o_proj"], lora_rank=8, seed=i, max_steps=3,
                      train_rows=chat_rows(4)) for i in range(3)]
    _pack(tiny, wide, tmp_path / "first", keeper)
    later = _specs("l")[:1]  # q_proj and v_proj at rank 4
    kept = _pack(tiny, later, tmp_path / "second", keeper)
    assert keeper.reuses == 1
    assert kept[0].adapter_dir is not None
    weights = load_file(str(kept[0].adapter_dir / "adapter_model.safetensors"))
    assert {tuple(t.shape) for k, t in weights.items() if "lora_A" in k} == {(4, 64)}  # its own rank, not 8
    # The kept engine's own shape is what it is kept by: the wide pack again takes it.
    _pack(tiny, wide, tmp_path / "third", keeper)
    assert keeper.reuses == 2
    keeper.drop()
    fresh = _pack(tiny, later, tmp_path / "fresh", None)
    # Equal up to float rounding: the kept engine's products run at its padded rank 8 (zero columns), which
    # changes the order of the sums, not their terms.
    assert kept[0].final_train_loss == pytest.approx(fresh[0].final_train_loss, rel=1e-5)
    assert kept[0].best_val_loss == pytest.approx(fresh[0].best_val_loss, rel=1e-5)
    assert fresh[0].adapter_dir is not None
    for key, tensor in load_file(str(fresh[0].adapter_dir / "adapter_model.safetensors")).items():
        torch.testing.assert_close(weights[key], tensor)
