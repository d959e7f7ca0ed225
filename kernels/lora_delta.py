"""The multi-LoRA path of one linear layer: grouped shrink and expand by token segments, forward and backward.

Pure torch: batched matmuls over a per-segment grid (a free view when segments are equal, else a gather),
or ``torch._grouped_mm`` where it is supported; no Python loop over slots. The backward is written out
(``_LoraDelta``) as the contract below, so it can accumulate dA and dB straight into the caller's
gradient store; the Triton issue replaces these calls with fused kernels behind the same function.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.dropout import LayerDropout
from kernels.layouts import Layout, layout_for
from kernels.segments import SegmentMeta


def lora_delta(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    meta: SegmentMeta,
    dropout: LayerDropout | None = None,
    base: torch.Tensor | None = None,
    grad_a: torch.Tensor | None = None,
    grad_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA outputs of every token under its own slot's adapter, added in place to ``base`` when given.

    Pseudo-code: for each segment ``s`` of slot ``z = meta.slot_ids[s]`` and each of its tokens ``n``::

        y[n] = base[n] + scale[z] * ((x[n] * K[n]) @ lora_a[z]) @ lora_b[z]       K: dropout multipliers

    Contract, per segment ``s`` of slot ``z`` with rows ``X_s`` (what the Triton kernels implement):

    forward::

        X̂_s  = X_s ⊙ K_s                 dropout (K from ``dropout``'s keys; 1 without dropout)
        S_s  = X̂_s A_z                    shrink, (L_s, r_max), accumulated in fp32
        S'_s = scale_z · S_s              rounded to x's dtype; saved for backward
        Y_s  = base_s + S'_s B_z          expand and add, (L_s, d_out)

    backward, given dY (X̂ is recomputed from the saved X and the keys; K is never stored)::

        dbase = dY
        dS'_s = dY_s B_zᵀ                 (L_s, r_max)
        dB_z += S'_sᵀ dY_s                (r_max, d_out)
        dS_s  = scale_z · dS'_s           rounded to x's dtype
        dA_z += X̂_sᵀ dS_s                 (d_in, r_max)
        dX_s  = (dS_s A_zᵀ) ⊙ K_s         (L_s, d_in); the caller's base layer adds its own dY Wᵀ

    Rank padding: a slot of rank ``r < r_max`` has ``A[z, :, r:] = 0`` and ``B[z, r:, :] = 0``, so
    ``S[:, r:] = 0`` and ``dS[:, r:] = 0``: the padded entries get exactly zero gradient. A slot with scale
    0 (it does not target this layer) gets exactly zero output and gradients; a slot without tokens, none.

    Args:
        x: ``(tokens, d_in)`` activations, ``tokens == meta.num_tokens``.
        lora_a: ``(Z, d_in, r_max)`` stacked A of every slot (any batch stride).
        lora_b: ``(Z, r_max, d_out)`` stacked B of every slot.
        scale: ``(Z,)`` float32 per-slot scale (``alpha / r`` or ``alpha / sqrt(r)``, 0 when not targeted).
        meta: the step's segments.
        dropout: the forward's dropout keys and this layer's feature keys, or ``None`` for no dropout.
        base: ``(tokens, d_out)`` contiguous (a view is fine), the frozen layer's output, or ``None``. It is
            updated in place and returned: the expand adds into it in its GEMM epilogue where it can
            (``baddbmm_``). It must not be a leaf that requires grad, nor a tensor autograd saved for
            backward (a linear layer's output is neither).
        grad_a: ``(Z, d_in, r_max)`` (any strides), or ``None``. When given, backward adds dA into it and
            autograd gets no gradient for ``lora_a`` (a flat gradient store, no per-layer accumulation).
        grad_b: ``(Z, r_max, d_out)``, likewise for ``lora_b``.

    Returns:
        ``(tokens, d_out)`` in x's dtype (``base`` itself when given).
    """
    n_tokens, d_in = x.shape
    z, _, r_max = lora_a.shape
    d_out = lora_b.shape[-1]
    assert n_tokens == meta.num_tokens, f"x has {n_tokens} tokens, the segments cover {meta.num_tokens}"
    assert z == meta.num_slots and lora_b.shape[:2] == (z, r_max), "A / B / meta disagree on slots or rank"
    assert scale.shape == (z,), f"scale {tuple(scale.shape)} is not ({z},)"
    assert grad_a is None or grad_a.shape == lora_a.shape, "grad_a does not match lora_a"
    assert grad_b is None or grad_b.shape == lora_b.shape, "grad_b does not match lora_b"
    if meta.num_segments == 0:
        return x.new_zeros(n_tokens, d_out) if base is None else base
    layout = layout_for(x, meta, (d_in, r_max, d_out))
    out: torch.Tensor = _LoraDelta.apply(base, x, lora_a, lora_b, scale, dropout, grad_a, grad_b, layout)
    return out


class _LoraDelta(torch.autograd.Function):
    """``lora_delta`` with its backward written out (see the contract there).

    ``base`` comes first: when it is a view that the forward modifies in place, autograd's view handling
    (CopySlices) routes the gradient of the Function's first input to it.
    """

    @staticmethod
    def forward(
        ctx: Any,
        base: torch.Tensor | None,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: torch.Tensor,
        dropout: LayerDropout | None,
        grad_a: torch.Tensor | None,
        grad_b: torch.Tensor | None,
        layout: Layout,
    ) -> torch.Tensor:
        a, b = layout.per_segment(lora_a), layout.per_segment(lora_b)  # (S, d_in, r), (S, r, d_out)
        xd = x if dropout is None else dropout.apply(x)
        s = (layout.mm(layout.rows(xd), a) * layout.scale(scale)).to(x.dtype)  # S'
        del xd
        y = layout.expand(s, b, base)
        if base is not None:
            ctx.mark_dirty(base)
        ctx.save_for_backward(x, lora_a, lora_b, scale, s)
        ctx.layout, ctx.dropout, ctx.grad_a, ctx.grad_b = layout, dropout, grad_a, grad_b
        ctx.has_base = base is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, lora_a, lora_b, scale, s = ctx.saved_tensors
        layout: Layout = ctx.layout
        dropout: LayerDropout | None = ctx.dropout
        a, b = layout.per_segment(lora_a), layout.per_segment(lora_b)
        dy_rows = layout.grad_rows(dy.contiguous())
        ds = layout.mm_t(dy_rows, b)  # dS' = dY Bᵀ
        grad_b = ctx.grad_b
        if grad_b is not None or ctx.needs_input_grad[3]:
            grad_b = grad_b if grad_b is not None else torch.zeros_like(lora_b)
            layout.accumulate_outer(grad_b, s, dy_rows)  # dB += S'ᵀ dY
        ds = (ds * layout.scale(scale)).to(dy.dtype)  # dS
        grad_a = ctx.grad_a
        if grad_a is not None or ctx.needs_input_grad[2]:
            grad_a = grad_a if grad_a is not None else torch.zeros_like(lora_a)
            xd = x if dropout is None else dropout.apply(x)
            layout.accumulate_outer(grad_a, layout.rows(xd), ds)  # dA += X̂ᵀ dS
        dx = None
        if ctx.needs_input_grad[1]:
            dx = layout.tokens(layout.mm_t(ds, a))  # dX̂ = dS Aᵀ
            if dropout is not None:
                dx = dropout.apply(dx)  # dX = dX̂ ⊙ K
        return (
            dy if ctx.has_base else None,
            dx,
            grad_a if ctx.grad_a is None else None,
            grad_b if ctx.grad_b is None else None,
            None,
            None,
            None,
            None,
            None,
        )
