"""Stacked multi-LoRA layers and the flat adapter store: semantics, init, gradients, injection, targets."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kernels import build_segments
from worker.engine.lora import (
    LoraConfig,
    LoraContext,
    StackedLoraLinear,
    TokenRouting,
    inject_lora,
    peft_target_modules,
    resolve_target_modules,
    restore_base_model,
)
from worker.engine.store import AdapterStore

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]
CPU = torch.device("cpu")


def _layer_with_two_slots() -> tuple[StackedLoraLinear, LoraContext, AdapterStore]:
    torch.manual_seed(0)
    context = LoraContext()
    layer = StackedLoraLinear(nn.Linear(6, 5, bias=True).requires_grad_(False), context, "proj")
    store = AdapterStore([layer], capacity=3, max_rank=3, device=CPU, compute_dtype=torch.float32)
    store.load_slot(0, {"proj": (torch.randn(2, 6), torch.randn(5, 2))}, rank=2, scale=2.0)
    store.load_slot(2, {"proj": (torch.randn(3, 6), torch.randn(5, 3))}, rank=3, scale=0.5)
    return layer, context, store


def test_each_token_gets_its_own_slots_update() -> None:
    layer, context, store = _layer_with_two_slots()
    x = torch.randn(2, 4, 6)  # (rows, seq, in): row 0 belongs to slot 2, row 1 to slot 0
    base = layer.base_layer(x)
    torch.testing.assert_close(layer(x), base, rtol=0, atol=0)  # no routing: the bare base layer
    routing = TokenRouting(build_segments([2, 0], [4, 4], num_slots=3, device=CPU))
    with context.routed(routing):
        y = layer(x)
    for row, slot, scale in [(0, 2, 0.5), (1, 0, 2.0)]:
        a, b = store.read(store.weights, slot)["proj"]  # PEFT layout: A (r, in), B (out, r)
        torch.testing.assert_close(y[row], base[row] + scale * (x[row] @ a.T @ b.T))
    assert LoraConfig(4, 8.0, 0.0).scale == 2.0 and LoraConfig(4, 8.0, 0.0, use_rslora=True).scale == 4.0


def test_gradients_land_in_their_slots_row_of_the_flat_store() -> None:
    layer, context, store = _layer_with_two_slots()
    with context.routed(TokenRouting(build_segments([2], [3], num_slots=3, device=CPU))):
        layer(torch.randn(3, 6)).sum().backward()
    assert store.grads[2].any() and not store.grads[0].any() and not store.grads[1].any()
    assert layer.lora_a is not None and layer.lora_a.grad is None  # written to the store, not by autograd
    assert layer.base_layer.weight.grad is None
    assert layer.grad_a is not None
    assert layer.grad_a[2].any()
    store.grads.zero_()
    # Slot 0 has rank 2 of max 3: its padded column gets exactly zero gradient.
    with context.routed(TokenRouting(build_segments([0], [3], num_slots=3, device=CPU))):
        layer(torch.randn(3, 6)).sum().backward()
    assert not layer.grad_a[0, :, 2].any() and store.grads[0].any()
    assert not store.grads[0, store.live_columns(0) :].any()  # the rank padding lies past the live columns


def test_init_is_peft_kaiming_from_the_seed_whatever_the_slot_or_pack(tiny: Tiny) -> None:
    model, _ = tiny
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(input_ids=ids).logits
    paths = resolve_target_modules(model, ["q_proj", "down_proj"])
    context = LoraContext()
    wide = resolve_target_modules(model, ["all-linear", "lm_head"])
    store = AdapterStore(inject_lora(model, wide, context), capacity=3, max_rank=8, device=CPU,
                         compute_dtype=torch.float32)
    store.init_slot(2, paths=paths, rank=4, scale=2.0, seed=5)
    with context.routed(TokenRouting(build_segments([2], [4], num_slots=3, device=CPU))):
        torch.testing.assert_close(model(input_ids=ids).logits, before)  # B = 0
    tensors = store.read(store.weights, 2)
    assert list(tensors) == paths and store.paths(2) == paths
    a, b = tensors["model.layers.0.self_attn.q_proj"]
    assert a.shape == (4, 64) and b.shape == (64, 4) and not b.any()
    expected = torch.empty(4, 64)
    nn.init.kaiming_uniform_(expected, a=math.sqrt(5), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, expected, rtol=0, atol=0)
    # The same seed in another slot of a pack wrapping fewer layers draws the same adapter.
    restore_base_model(model)
    small = AdapterStore(inject_lora(model, paths, LoraContext()), capacity=1, max_rank=4, device=CPU,
                         compute_dtype=torch.float32)
    small.init_slot(0, paths=paths, rank=4, scale=2.0, seed=5)
    for path, (a2, b2) in small.read(small.weights, 0).items():
        assert torch.equal(a2, tensors[path][0]) and torch.equal(b2, tensors[path][1])


def test_inject_and_restore_give_back_the_plain_model(tiny: Tiny) -> None:
    model, _ = tiny
    ids = torch.tensor([[5, 6, 7]])
    before = model(input_ids=ids).logits
    layers = inject_lora(model, resolve_target_modules(model, ["all-linear"]), LoraContext())
    assert len(layers) == 14 and all(isinstance(m, StackedLoraLinear) for m in layers)
    with pytest.raises(ValueError, match="already has LoRA layers"):
        inject_lora(model, ["lm_head"], LoraContext())
    restore_base_model(model)
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules())
    assert type(model.model.layers[0].self_attn.v_proj) is nn.Linear
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not linear layers"):
        inject_lora(model, ["model.layers.0.mlp"], LoraContext())
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules())  # nothing half-wrapped


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
