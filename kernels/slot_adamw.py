"""AdamW over the rows of a slot-stacked ``(Z, P)`` store in one Triton kernel, each row only as far as it is live.

A pack's adapters are padded to its largest rank, but a slot of rank ``r`` uses only the first ``r / r_max``
of its row when the store lays its row out rank by rank (``worker.engine.store``): the kernel reads each
row's live length and never touches the padding, so a pack of ranks 16/32/64 moves 58% of the bytes a
full-row update would. Per element it reads the fp32 parameter and moments and the gradient, and writes the
parameter, the moments and (optionally) the compute-dtype copy of the parameter that the layers read.

The arithmetic is ``torch.optim.AdamW``'s single-tensor path operation by operation, IEEE-rounded square root
and division, with per-slot scalars from a ``(8, Z)`` float32 table (see ``slot_adamw_``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements per program; a row's programs past its live columns exit at once


@triton.jit
def _slot_adamw_kernel(
    p_ptr, m_ptr, v_ptr, g_ptr, c_ptr, live_ptr, table_ptr,
    P, Z,
    HAS_COMPUTE: tl.constexpr, LIVE_MULTIPLE_OF_16: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    z = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = tl.load(live_ptr + z)
    if LIVE_MULTIPLE_OF_16:
        # A mask known to change only every 16 columns keeps the loads and stores 16 bytes wide (a bound read
        # from memory is otherwise any number, and every access one element: ~25% slower on an H100).
        live = tl.multiple_of(live, 16)
    if tl.program_id(0) * BLOCK < live:
        mask = cols < live
        offs = z.to(tl.int64) * P + cols
        coef = tl.load(table_ptr + 0 * Z + z)
        decay = tl.load(table_ptr + 1 * Z + z)
        beta1c = tl.load(table_ptr + 2 * Z + z)
        beta2 = tl.load(table_ptr + 3 * Z + z)
        beta2c = tl.load(table_ptr + 4 * Z + z)
        bc2_sqrt = tl.load(table_ptr + 5 * Z + z)
        eps = tl.load(table_ptr + 6 * Z + z)
        neg_step = tl.load(table_ptr + 7 * Z + z)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * coef
        p = tl.load(p_ptr + offs, mask=mask, other=0.0) * decay
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        m = m + beta1c * (g - m)  # torch.lerp with a weight below 0.5
        v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + (g * beta2c) * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p + tl.div_rn(m * neg_step, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_COMPUTE:
            tl.store(c_ptr + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


def slot_adamw_(
    params: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grads: torch.Tensor,
    compute: torch.Tensor | None,
    live: torch.Tensor,
    table: torch.Tensor,
    *,
    live_multiple_of_16: bool | None = None,
) -> None:
    """One AdamW update, in place, of columns ``[0, live[z])`` of every row ``z``.

    Args:
        params, exp_avg, exp_avg_sq: ``(Z, P)`` float32, contiguous.
        grads: ``(Z, P)`` gradients (any float dtype), contiguous.
        compute: ``(Z, P)`` copy of ``params`` in a lower precision to refresh, or ``None``.
        live: ``(Z,)`` int32 columns to update per row (0: the row is left as it is).
        live_multiple_of_16: whether every ``live`` is a multiple of 16 (found from ``live`` when ``None``).
        table: ``(8, Z)`` float32 per-row scalars: gradient multiplier (clipping), ``1 - lr·wd``,
            ``1 - beta1``, ``beta2``, ``1 - beta2``, ``sqrt(bias correction 2)``, ``eps``, ``-lr / bias correction 1``.
    """
    z, p = params.shape
    for t in (params, exp_avg, exp_avg_sq, grads) + ((compute,) if compute is not None else ()):
        assert t.shape == (z, p) and t.is_contiguous(), "the store's matrices are (Z, P) and contiguous"
    assert live.shape == (z,) and table.shape == (8, z) and table.dtype == torch.float32
    if z == 0 or p == 0:
        return
    if live_multiple_of_16 is None:  # (a device sync when live is on the device: callers pass it)
        live_multiple_of_16 = bool((live % 16 == 0).all())

    grid = (triton.cdiv(p, BLOCK), z)
    _slot_adamw_kernel[grid](
        params, exp_avg, exp_avg_sq, grads, compute if compute is not None else params, live, table.contiguous(),
        p, z, HAS_COMPUTE=compute is not None, LIVE_MULTIPLE_OF_16=live_multiple_of_16, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
