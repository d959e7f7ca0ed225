"""AdamW for every slot at once: vectorised over the slot axis of the flat ``(Z, P)`` store.

Each slot has its own lr (its schedule at its own step), betas, eps, decoupled weight decay, bias
correction by its own step count and optional clipping by its own global gradient norm. The arithmetic
follows ``torch.optim.AdamW``'s single-tensor path and ``torch.nn.utils.clip_grad_norm_`` operation by
operation, with the per-slot scalars broadcast as ``(Z, 1)`` columns: no optimizer objects per slot and no
loop over slots.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Column chunk of the eager update, in elements of (Z, cols): bounds its fp32 temporaries (bf16 grads cast
# up, sqrt(v)) to ~128 MiB each, instead of several full copies of a multi-GiB store.
CHUNK_ELEMENTS = 2**25


@dataclass(frozen=True)
class AdamWHyper:
    """One slot's optimizer hyperparameters (``torch.optim.AdamW``'s, plus clipping)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None


class SlotAdamW:
    """AdamW over the rows of ``params`` (``(Z, P)`` fp32), reading gradients from ``grads`` (``(Z, P)``).

    Rows that are not stepped (free slots, slots not in this step) are left exactly as they are. With
    ``compute`` (the store's bf16 copy of ``params``), each step also refreshes it, in the same pass.
    On CUDA the update is one Triton kernel over the store (``kernels.slot_adamw``: 28 bytes of memory
    traffic per element instead of ~110 for the eager ops) that updates each row only as far as the caller
    says it is live (a slot's true rank, not the pack's padded one). Elsewhere, or without Triton, it runs
    eagerly in column chunks that bound the fp32 temporaries.
    """

    def __init__(self, params: torch.Tensor, grads: torch.Tensor, compute: torch.Tensor | None = None) -> None:
        assert params.dtype == torch.float32 and params.shape == grads.shape
        self.params, self.grads = params, grads
        self.compute = compute if compute is not None and compute is not params else None
        self.exp_avg = torch.zeros_like(params)
        self.exp_avg_sq = torch.zeros_like(params)
        capacity = params.shape[0]
        self.hyper: list[AdamWHyper | None] = [None] * capacity
        self.steps: list[int] = [0] * capacity  # updates each slot has taken
        self._fused = params.is_cuda and _fused_kernel() is not None

    def reset(self, slot: int, hyper: AdamWHyper) -> None:
        """Fresh state for ``slot``: zero moments, step 0."""
        self.clear(slot)
        self.hyper[slot] = hyper

    def clear(self, slot: int) -> None:
        """Forget ``slot`` entirely (its moments become zeros)."""
        self.exp_avg[slot].zero_()
        self.exp_avg_sq[slot].zero_()
        self.hyper[slot], self.steps[slot] = None, 0

    @torch.no_grad()
    def step(self, lrs: dict[int, float], live: dict[int, int] | None = None) -> None:
        """One AdamW update of the slots in ``lrs`` (slot -> this step's learning rate).

        ``live`` (slot -> columns) says how much of each stepped row is in use; the rest of the row must be
        zeros with zero gradient (AdamW would leave it so). ``None``: whole rows. Host work is a ``(9, Z)``
        table of per-slot scalars, copied to the device once; no device sync.
        """
        if not lrs:
            return
        table = self._coefficients(lrs)  # host
        any_clipping = bool(table[8].any())
        device_table = table.to(self.params.device, non_blocking=True)
        clip_max, decay, beta1c, beta2, beta2c, bc2_sqrt, eps, neg_step, clipping = device_table.unsqueeze(-1)
        coef = self._clip_coefficients(clip_max, clipping) if any_clipping else torch.ones_like(clip_max)
        if self._fused:
            kernel = _fused_kernel()
            assert kernel is not None
            width = self.params.shape[1]
            columns = [(live or {}).get(slot, width) if slot in lrs else 0 for slot in range(len(self.hyper))]
            live_t = torch.tensor(columns, dtype=torch.int32).to(self.params.device, non_blocking=True)
            scalars = torch.cat([coef.T, device_table[1:8]])
            kernel(self.params, self.exp_avg, self.exp_avg_sq, self.grads, self.compute, live_t, scalars,
                   live_multiple_of_16=all(c % 16 == 0 for c in columns))
        else:
            for cols in self._chunks():
                compute = self.compute[:, cols] if self.compute is not None else None
                chunk = (self.params[:, cols], self.exp_avg[:, cols], self.exp_avg_sq[:, cols], self.grads[:, cols])
                _adamw_update(*chunk, compute, coef, decay, beta1c, beta2, beta2c, bc2_sqrt, eps, neg_step)
        for slot in lrs:
            self.steps[slot] += 1

    def _coefficients(self, lrs: dict[int, float]) -> torch.Tensor:
        """Per-slot scalars in float64 on the host; rows not stepped get the identity update."""
        capacity = self.params.shape[0]
        # clip_max decay 1-b1 b2 1-b2 sqrt(bc2) eps -lr/bc1 clipping?
        identity = [math.inf, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
        columns = [identity] * capacity
        for slot, lr in lrs.items():
            hyper = self.hyper[slot]
            if hyper is None:
                raise ValueError(f"slot {slot} has no optimizer state")
            step = self.steps[slot] + 1
            bias_correction1 = 1 - hyper.beta1**step
            bias_correction2 = 1 - hyper.beta2**step
            columns[slot] = [
                hyper.max_grad_norm if hyper.max_grad_norm is not None else math.inf,
                1 - lr * hyper.weight_decay,
                1 - hyper.beta1,
                hyper.beta2,
                1 - hyper.beta2,
                bias_correction2**0.5,
                hyper.eps,
                -lr / bias_correction1,
                1.0 if hyper.max_grad_norm is not None else 0.0,
            ]
        return torch.tensor(columns, dtype=torch.float64).T.to(torch.float32)

    def _clip_coefficients(self, clip_max: torch.Tensor, clipping: torch.Tensor) -> torch.Tensor:
        """``(Z, 1)`` multipliers: ``clip_grad_norm_``'s ``min(1, max_norm / (norm + 1e-6))`` per slot, else 1."""
        # The norm of per-chunk norms, as clip_grad_norm_ takes the norm of per-parameter norms; dtype=
        # accumulates bf16 gradients in fp32 without an fp32 copy.
        norms = [
            torch.linalg.vector_norm(self.grads[:, cols], dim=1, keepdim=True, dtype=torch.float32)
            for cols in self._chunks()
        ]
        total = torch.linalg.vector_norm(torch.cat(norms, dim=1), dim=1, keepdim=True)
        coef = torch.clamp(clip_max / (total + 1e-6), max=1.0)
        return torch.where(clipping > 0, coef, torch.ones_like(coef))

    def _chunks(self) -> list[slice]:
        capacity, width = self.params.shape
        step = max(1, CHUNK_ELEMENTS // capacity)
        return [slice(start, min(start + step, width)) for start in range(0, width, step)]


def _adamw_update(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    compute: torch.Tensor | None,
    coef: torch.Tensor,
    decay: torch.Tensor,
    beta1c: torch.Tensor,
    beta2: torch.Tensor,
    beta2c: torch.Tensor,
    bc2_sqrt: torch.Tensor,
    eps: torch.Tensor,
    neg_step: torch.Tensor,
) -> None:
    """In-place AdamW on a ``(Z, cols)`` chunk; the scalars are ``(Z, 1)`` columns.

    Operation for operation ``torch.optim.AdamW``'s single-tensor path: decoupled decay, lerp of the
    first moment, ``addcmul`` of the second, ``(sqrt(v) / sqrt(bc2)) + eps``, ``addcdiv`` by ``-lr / bc1``.
    """
    g = grad.float() * coef  # clip_grad_norm_'s multiply (by exactly 1 where no clipping applies)
    param.mul_(decay)
    exp_avg.lerp_(g, beta1c)
    # (beta2c * g) * g: the operand order of addcmul_(g, g, value=1 - beta2).
    exp_avg_sq.mul_(beta2).addcmul_(g * beta2c, g)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg * neg_step, denom)
    if compute is not None:
        compute.copy_(param)


@functools.cache
def _fused_kernel() -> Callable[..., None] | None:
    """``kernels.slot_adamw.slot_adamw_``, or ``None`` where Triton does not import."""
    try:
        from kernels.slot_adamw import slot_adamw_
    except Exception as exc:  # ImportError, or a Triton that fails at import on this machine
        logger.warning("Triton AdamW unavailable (%s); the eager update runs", exc)
        return None
    return slot_adamw_
