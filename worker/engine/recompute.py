"""Activation checkpointing of the decoder layers, LoRA routing included.

A LoRA layer keeps its input for dA (a frozen layer keeps nothing), so a pack of many trials runs out of
memory long before the frozen model would. Recomputing each decoder layer in the backward keeps only the
layers' inputs. The recompute must route tokens exactly as the forward did: the routing of the moment is
captured and put back around the recomputation (dropout masks are a hash of the step, so they repeat).
Forwards must run with ``use_cache=False``: a recomputed layer would append its keys to the cache twice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from worker.engine.distributed import decoder_layers
from worker.engine.lora import RECOMPUTE_MARK, LoraContext, override_forward


def enable_recompute(model: nn.Module, context: LoraContext) -> None:
    """Make every decoder layer recompute its activations in the backward (``restore_base_model`` undoes it)."""
    for layer in decoder_layers(model):
        original = layer.forward

        def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            routing = context.routing  # the recompute happens after the forward's `routed` block has ended

            def run(*a: Any, **k: Any) -> Any:
                with context.routed(routing):
                    return _original(*a, **k)

            if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
                return run(*args, **kwargs)
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

        override_forward(layer, forward, RECOMPUTE_MARK)

