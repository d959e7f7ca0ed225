"""The slow, obviously-correct LoRA path: a Python loop over segments. The oracle for ``lora_delta``."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lora_delta_loop(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    slot_ids: Sequence[int],
    lengths: Sequence[int],
    keep_scale: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[n] = base[n] + scale[z] * ((x[n] * keep_scale[n]) @ lora_a[z]) @ lora_b[z]``, one segment at a time.

    Args:
        x: ``(tokens, d_in)``; segments laid end to end from token 0 cover all of it.
        lora_a: ``(Z, d_in, r_max)``.
        lora_b: ``(Z, r_max, d_out)``.
        scale: ``(Z,)``.
        slot_ids: slot of each segment.
        lengths: tokens of each segment.
        keep_scale: ``(tokens, d_in)`` dropout multipliers, or ``None``.
        base: ``(tokens, d_out)`` or ``None``.

    Returns:
        ``(tokens, d_out)`` in x's dtype.
    """
    assert sum(lengths) == x.shape[0], "segments must cover every token"
    if keep_scale is not None:
        x = x * keep_scale
    pieces = [x.new_zeros(0, lora_b.shape[-1])]
    start = 0
    for z, n in zip(slot_ids, lengths, strict=True):
        s = (x[start : start + n] @ lora_a[z]) * scale[z]
        pieces.append(s.to(x.dtype) @ lora_b[z])
        start += n
    y = torch.cat(pieces)
    return y if base is None else base + y
