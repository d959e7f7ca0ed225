"""Activation checkpointing changes memory, not results: the same losses and adapters as without it."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import make_spec
from tests.engine.test_engine import MIXED
from worker.engine import PackEngine
from worker.engine.distributed import decoder_layers
from worker.engine.lora import RECOMPUTE_MARK, resolve_target_modules
from worker.engine.store import ModuleTensors

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def _train(
    tiny: Tiny, *, recompute: bool, steps: int = 4
) -> tuple[list[dict[str, float]], list[ModuleTensors], int]:
    """(losses per step, adapters, forward calls of the first layer's attention)."""
    model, tokenizer = tiny
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    hook = decoder_layers(model)[0].self_attn.register_forward_hook(count)
    specs = [make_spec(name, **fields) for name, fields in MIXED.items()]
    paths = sorted({p for s in specs for p in resolve_target_modules(model, s.target_modules)})
    with PackEngine(model, tokenizer, capacity=len(specs), max_rank=max(s.lora_rank for s in specs),
                    target_modules=paths, activation_checkpointing=recompute) as engine:
        slots = [engine.admit(spec) for spec in specs]
        losses = [engine.step() for _ in range(steps)]
        adapters = [engine.adapter(slot) for slot in slots]
    hook.remove()
    return losses, adapters, calls


def test_recomputed_pack_trains_exactly_like_the_stored_one(tiny: Tiny) -> None:
    plain_losses, plain, plain_calls = _train(tiny, recompute=False)
    losses, adapters, calls = _train(tiny, recompute=True)
    assert (plain_calls, calls) == (4, 8)  # each step's forward, and with recompute once more in the backward
    for got_step, want_step in zip(losses, plain_losses, strict=True):
        assert got_step.keys() == want_step.keys()
        for trial, loss in want_step.items():
            assert abs(got_step[trial] - loss) <= 1e-6 * abs(loss)
    for got, want in zip(adapters, plain, strict=True):
        assert got.keys() == want.keys()
        for path in want:
            for g, w in zip(got[path], want[path], strict=True):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


def test_closing_the_engine_undoes_the_recompute_wrappers(tiny: Tiny) -> None:
    model, tokenizer = tiny
    with PackEngine(model, tokenizer, capacity=1, activation_checkpointing=True):
        assert all(getattr(layer, RECOMPUTE_MARK, False) for layer in decoder_layers(model))
    assert not any(getattr(layer, RECOMPUTE_MARK, False) or "forward" in vars(layer)
                   for layer in decoder_layers(model))
