"""Which fused base ops run: chosen by LORAPLANE_FUSED_OPS, none on the CPU (the exact path).

Their numbers are checked on a GPU (tests/engine/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from worker.engine.base_model import build_tiny_llama
from worker.engine.fused import FUSED_OPS, chosen_ops, fuse, unfuse


def test_the_setting_picks_all_none_or_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLANE_FUSED_OPS", raising=False)
    assert chosen_ops() == FUSED_OPS
    monkeypatch.setenv("LORAPLANE_FUSED_OPS", "none")
    assert chosen_ops() == ()
    monkeypatch.setenv("LORAPLANE_FUSED_OPS", "rmsnorm, rope")
    assert chosen_ops() == ("rmsnorm", "rope")
    monkeypatch.setenv("LORAPLANE_FUSED_OPS", "rmsnorm,layernorm")
    with pytest.raises(ValueError, match="layernorm"):
        chosen_ops()


def test_nothing_is_fused_on_the_cpu() -> None:
    model = build_tiny_llama(vocab_size=300, pad_token_id=0, eos_token_id=1)
    before = model(input_ids=torch.tensor([[3, 4, 5]])).logits
    assert fuse(model, FUSED_OPS) == []
    assert not any("forward" in vars(m) for m in model.modules())
    unfuse(model)
    assert torch.equal(model(input_ids=torch.tensor([[3, 4, 5]])).logits, before)
