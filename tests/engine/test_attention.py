"""Packed attention: a row inside a packed stream computes exactly what it computes alone."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from common.tiny_tokenizer import TINY_TOKENIZER
from tests.engine.factories import make_spec
from worker.engine.attention import ATTENTION_NAME, use_packed_attention
from worker.engine.base_model import build_tiny_tokenizer
from worker.engine.pack_engine import PackEngine

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _models() -> list[PreTrainedModel]:
    torch.manual_seed(0)
    # Grouped-query attention in both; Qwen2 adds q/k/v biases.
    return [LlamaForCausalLM(LlamaConfig(**SMALL)).eval(), Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()]


@pytest.mark.parametrize("model", _models(), ids=lambda m: type(m).__name__)
def test_a_packed_row_has_the_logits_and_gradients_of_the_row_alone(model: PreTrainedModel) -> None:
    rows = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 1, 9)]
    embed = model.get_input_embeddings()
    alone, alone_grads = [], []
    for row in rows:
        inputs = embed(row[None]).detach().requires_grad_(True)
        logits = model(inputs_embeds=inputs).logits[0]  # transformers' own SDPA attention, one row
        logits.square().mean().backward()
        alone.append(logits.detach())
        alone_grads.append(inputs.grad[0])

    previous = use_packed_attention(model.config)
    try:
        bounds = torch.tensor([0, 5, 22, 23, 32], dtype=torch.int32)
        inputs = embed(torch.cat(rows)[None]).detach().requires_grad_(True)
        positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
        logits = model(
            inputs_embeds=inputs,
            position_ids=positions,
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=17,
            max_length_k=17,
        ).logits[0]
        # The same per-row objective as above: each row's mean over its own tokens.
        sum(logits[a:b].square().mean() for a, b in zip(bounds.tolist(), bounds.tolist()[1:], strict=False)).backward()
    finally:
        model.config._attn_implementation = previous
    torch.testing.assert_close(logits.detach(), torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert inputs.grad is not None
    torch.testing.assert_close(inputs.grad[0], torch.cat(alone_grads), rtol=1e-5, atol=1e-6)


def test_packed_attention_refuses_a_forward_without_row_boundaries() -> None:
    model = _models()[0]
    use_packed_attention(model.config)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_the_engine_switches_attention_for_its_life_only() -> None:
    model = _models()[0]
    assert model.config._attn_implementation == "sdpa"
    tokenizer = build_tiny_tokenizer(TINY_TOKENIZER)
    with PackEngine(model, tokenizer, capacity=1) as engine:
        assert model.config._attn_implementation == ATTENTION_NAME
        engine.admit(make_spec("a"))
        engine.step()
    assert model.config._attn_implementation == "sdpa"
    model(input_ids=torch.tensor([[1, 2, 3]]))  # the bare model runs as before
