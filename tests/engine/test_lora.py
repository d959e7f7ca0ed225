"""MultiLoraLinear semantics, slot isolation, target resolution and restoring the base model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine.lora import (
    AdapterContext,
    LoraConfig,
    MultiLoraLinear,
    adapter_tensors,
    add_adapter,
    peft_target_modules,
    remove_adapter,
    resolve_target_modules,
    restore_base_model,
    set_active_adapter,
)

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def _layer_with_two_slots() -> tuple[MultiLoraLinear, AdapterContext]:
    torch.manual_seed(0)
    context = AdapterContext()
    layer = MultiLoraLinear(nn.Linear(6, 5, bias=True).requires_grad_(False), context)
    for slot, (rank, alpha) in enumerate([(2, 4.0), (3, 1.5)]):
        context.slots[slot] = LoraConfig(rank=rank, alpha=alpha, dropout=0.5)
        context.dropout_generators[slot] = torch.Generator().manual_seed(slot)
        layer.add_slot(slot, torch.randn(rank, 6), torch.randn(5, rank))
    return layer, context


def test_forward_is_base_plus_scaled_low_rank_update_of_the_active_slot() -> None:
    layer, context = _layer_with_two_slots()
    x = torch.randn(3, 4, 6)  # (batch, seq, in)
    base = layer.base_layer(x)
    context.active = None
    torch.testing.assert_close(layer(x), base, rtol=0, atol=0)
    for slot, scale in [(0, 4.0 / 2), (1, 1.5 / 3)]:
        context.active = slot
        a, b = layer.lora_A[str(slot)], layer.lora_B[str(slot)]
        torch.testing.assert_close(layer(x), base + scale * (x @ a.T @ b.T))


def test_dropout_applies_only_in_training_to_the_lora_input() -> None:
    layer, context = _layer_with_two_slots()
    x = torch.randn(64, 6)
    context.active, context.training = 0, False
    eval_out = layer(x)
    context.training = True
    train_out = layer(x)
    assert not torch.allclose(train_out, eval_out)
    # The dropped-out LoRA input is x * keep / (1 - p): redraw the same mask from a fresh generator.
    keep = torch.empty_like(x).bernoulli_(0.5, generator=torch.Generator().manual_seed(0))
    a, b = layer.lora_A["0"], layer.lora_B["0"]
    torch.testing.assert_close(train_out, layer.base_layer(x) + 2.0 * ((x * keep / 0.5) @ a.T @ b.T))


def test_gradients_reach_only_the_active_slot() -> None:
    layer, context = _layer_with_two_slots()
    context.active = 1
    layer(torch.randn(2, 6)).sum().backward()
    assert layer.lora_A["1"].grad is not None and layer.lora_B["1"].grad is not None
    assert layer.lora_A["0"].grad is None and layer.lora_B["0"].grad is None
    assert layer.base_layer.weight.grad is None


def test_add_adapter_inits_like_peft_and_leaves_output_unchanged(tiny: Tiny) -> None:
    model, _ = tiny
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(input_ids=ids).logits
    paths = resolve_target_modules(model, ["q_proj", "down_proj"])
    params = add_adapter(model, 0, LoraConfig(4, 8.0, 0.0), paths, init_seed=5, dropout_seed=6)
    assert len(params) == 2 * len(paths) == 8
    set_active_adapter(model, 0)
    torch.testing.assert_close(model(input_ids=ids).logits, before)  # B = 0
    tensors = adapter_tensors(model, 0)
    assert list(tensors) == paths
    a, b = tensors["model.layers.0.self_attn.q_proj"]
    assert a.shape == (4, 64) and b.shape == (64, 4) and not b.any()
    bound = 1 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on fan_in 64, as nn.Linear and PEFT
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    expected = torch.empty(4, 64)
    nn.init.kaiming_uniform_(expected, a=math.sqrt(5), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, expected, rtol=0, atol=0)


def test_slots_come_and_go_and_restore_gives_back_plain_linears(tiny: Tiny) -> None:
    model, _ = tiny
    ids = torch.tensor([[5, 6, 7]])
    before = model(input_ids=ids).logits
    add_adapter(
        model, 0, LoraConfig(2, 2.0, 0.0), resolve_target_modules(model, ["v_proj"]), init_seed=0, dropout_seed=0
    )
    add_adapter(
        model, 1, LoraConfig(2, 2.0, 0.0), resolve_target_modules(model, ["all-linear"]), init_seed=1, dropout_seed=1
    )
    with pytest.raises(ValueError, match="already in use"):
        add_adapter(model, 1, LoraConfig(2, 2.0, 0.0), ["lm_head"], init_seed=0, dropout_seed=0)
    remove_adapter(model, 0)
    assert adapter_tensors(model, 0) == {}
    assert len(adapter_tensors(model, 1)) == 14  # 7 linears x 2 layers; lm_head excluded by all-linear
    with pytest.raises(ValueError, match="no adapter"):
        set_active_adapter(model, 0)
    restore_base_model(model)
    assert not any(isinstance(m, MultiLoraLinear) for m in model.modules())
    assert type(model.model.layers[0].self_attn.v_proj) is nn.Linear
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_resolve_target_modules(tiny: Tiny) -> None:
    model, _ = tiny
    assert resolve_target_modules(model, ["q_proj", "v_proj"]) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert resolve_target_modules(model, ["layers.1.mlp.up_proj"]) == ["model.layers.1.mlp.up_proj"]
    assert "lm_head" not in resolve_target_modules(model, ["all-linear"])
    assert resolve_target_modules(model, ["all-linear", "lm_head"])[-1] == "lm_head"
    with pytest.raises(ValueError, match=r"target module 'qproj' matches no linear layer.*'q_proj'"):
        resolve_target_modules(model, ["q_proj", "qproj"])
    with pytest.raises(ValueError, match="matches no linear layer"):
        resolve_target_modules(model, ["mlp"])  # a module, but not a linear one
    with pytest.raises(ValueError, match="empty"):
        resolve_target_modules(model, [])


def test_peft_target_modules_uses_suffixes_only_when_they_select_exactly(tiny: Tiny) -> None:
    model, _ = tiny
    every = resolve_target_modules(model, ["all-linear"])
    assert peft_target_modules(model, every) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    one_layer = resolve_target_modules(model, ["layers.0.self_attn.q_proj"])
    assert peft_target_modules(model, one_layer) == ["model.layers.0.self_attn.q_proj"]
