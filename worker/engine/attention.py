"""Attention over a packed token stream: every row of a step laid end to end in one sequence, no padding.

The engine runs the model on one ``(1, tokens)`` stream whose position ids restart at 0 with each row (so
rotary embeddings see each row as if it ran alone) and routes attention through ``packed_attention``,
registered with transformers' ``AttentionInterface`` as ``ATTENTION_NAME``: each row attends causally to
itself only. The row boundaries travel as transformers' own variable-length keyword arguments
(``cu_seq_lens_q`` / ``max_length_q``, what its FlashAttention path reads), which every decoder passes from
``model(...)`` down to its attention function. Under that name transformers builds no mask at all.

Two paths, the same function:

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's variable-length kernel): one call
  per layer for all rows; CUDA, bf16/fp16, torch >= 2.10.
- ``rows``: ``scaled_dot_product_attention`` with a causal mask on each row in turn; any device and dtype,
  exact, what the CPU tests run (a row's output equals the row run alone through the model's own SDPA).

Sliding windows (Mistral, Qwen2, Gemma 2/3's local layers) follow transformers' rule: query ``i`` sees keys
``i - window < j <= i``; the varlen kernel takes that as ``window_size=(window - 1, 0)``. A soft cap on the
attention scores (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(scores / cap)``) has no varlen form in
torch, so such layers take the rows path, computed as the model's own eager attention computes it.

``LORAPLANE_ATTENTION`` (auto / varlen / rows) overrides the choice, so a benchmark can time both.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

ATTENTION_NAME = "loraplane_packed"
ATTENTION_PATHS = ("auto", "varlen", "rows")


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each row of a packed stream (transformers' attention-function signature).

    Args:
        query: ``(1, heads, tokens, head_dim)``; key, value: ``(1, kv_heads, tokens, head_dim)``.
        attention_mask: must be ``None`` (the rows are the mask).
        scaling: the softmax scale (``head_dim ** -0.5`` when ``None``).
        kwargs: ``cu_seq_lens_q`` ``(rows + 1,)`` int32 row starts and end, ``max_length_q`` the longest row.

    Returns:
        ``((1, tokens, heads, head_dim), None)``.

    Raises:
        ValueError: no row boundaries (a model that does not pass its keyword arguments down), a batch of
            more than one stream, a mask, attention dropout, or a non-causal layer.
    """
    cu_seqlens, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu_seqlens is None or max_len is None:
        raise ValueError(f"{type(module).__name__}: packed attention needs cu_seq_lens_q and max_length_q")
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("packed attention takes one stream of shape (1, tokens) and no attention mask")
    if dropout or not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__}: packed attention is causal, without dropout")
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    # A window no row reaches the end of changes nothing: the rows then run as plain causal attention.
    window = int(window) if window is not None and int(max_len) > int(window) else None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    path = attention_path(query, softcap=softcap is not None)
    if path == "varlen":
        out = _varlen(query, key, value, cu_seqlens, int(max_len), scale, window)
    else:
        out = _rows(query, key, value, cu_seqlens, scale, window, None if softcap is None else float(softcap))
    return out, None


def attention_path(query: torch.Tensor, *, softcap: bool = False) -> str:
    """``"varlen"`` or ``"rows"``: what ``packed_attention`` runs for ``query`` (see the module docstring)."""
    chosen = os.environ.get("LORAPLANE_ATTENTION", "auto")
    if chosen not in ATTENTION_PATHS:
        raise ValueError(f"LORAPLANE_ATTENTION={chosen!r}: choose one of {ATTENTION_PATHS}")
    usable = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None
    if chosen == "varlen" and (not usable or softcap):
        raise RuntimeError(f"varlen attention cannot run on {query.device} {query.dtype} (soft cap: {softcap}) here")
    return "varlen" if usable and not softcap and chosen != "rows" else "rows"


def use_packed_attention(config: PretrainedConfig) -> str:
    """Switch a model's attention to ``packed_attention``; returns the implementation to put back."""
    previous = str(config._attn_implementation)
    config._attn_implementation = ATTENTION_NAME
    return previous


def _rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(query)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        rows = slice(start, end)
        q, k, v = query[:, :, rows], key[:, :, rows], value[:, :, rows]
        if window is None and softcap is None:
            out[:, :, rows] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            continue
        positions = torch.arange(end - start, device=query.device)
        offset = positions[:, None] - positions[None, :]  # query i minus key j
        visible = (offset >= 0) & (offset < window if window is not None else True)
        if softcap is None:
            out[:, :, rows] = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
            continue
        # As the model's eager attention: scores in its dtype, capped, masked, softmax in fp32.
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[:, :, rows] = torch.matmul(weights, v)
    return out.transpose(1, 2)


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    found = _varlen_attn()
    assert found is not None
    varlen_attn, causal, gqa = found
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    extra = dict(causal)
    if window is not None:
        if "window_size" not in causal:
            raise RuntimeError("this torch's varlen attention takes no window_size: set LORAPLANE_ATTENTION=rows")
        extra["window_size"] = (window - 1, 0)  # keys i - window < j <= i, transformers' rule
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        if gqa:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **extra)
    return out.unsqueeze(0)


@functools.cache
def _varlen_attn() -> tuple[Callable[..., torch.Tensor], dict[str, Any], bool] | None:
    """torch's variable-length attention, the keyword arguments that make it causal and whether it takes
    fewer key/value heads (``enable_gqa``); ``None`` without it.

    Its signature moved between releases: causal is ``is_causal=True`` in some, ``window_size=(-1, 0)`` in others.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return cast(Callable[..., torch.Tensor], varlen_attn), causal, "enable_gqa" in params


AttentionInterface.register(ATTENTION_NAME, packed_attention)
