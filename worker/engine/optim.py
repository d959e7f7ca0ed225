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
from typing import Any

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
    On CUDA the update is compiled into one fused elementwise kernel over the whole store (28 bytes of
    memory traffic per element instead of ~110 for the eager ops: at 32 slots of a rank-64-padded
    Llama-3.2-1B, ~10 ms instead of ~65 ms per step; compiled once per store shape, a few seconds).
    Elsewhere, or if compiling fails, it runs eagerly in column chunks that bound the fp32 temporaries.
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
        self._compiled = params.is_cuda

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
    def step(self, lrs: dict[int, float]) -> None:
        """One AdamW update of the slots in ``lrs`` (slot -> this step's learning rate).

        Host work is a ``(9, Z)`` table of per-slot scalars, copied to the device once; no device sync.
        """
        if not lrs:
            return
        table = self._coefficients(lrs)  # host
        any_clipping = bool(table[8].any())
        clip_max, decay, beta1c, beta2, beta2c, bc2_sqrt, eps, neg_step, clipping = table.to(
            self.params.device, non_blocking=True
        ).unsqueeze(-1)
        coef = self._clip_coefficients(clip_max, clipping) if any_clipping else torch.ones_like(clip_max)
        scalars = (coef, decay, beta1c, beta2, beta2c, bc2_sqrt, eps, neg_step)
        if self._compiled:
            try:  # one fused kernel over the whole store: it has no temporaries to bound
                update = _compiled_update(tuple(self.params.shape))
                update(self.params, self.exp_avg, self.exp_avg_sq, self.grads, self.compute, *scalars)
            except Exception as exc:  # compiling failed, before any tensor was touched: go eager for good
                logger.warning("compiled AdamW update failed (%s); using the eager one", exc)
                self._compiled = False
        if not self._compiled:
            for cols in self._chunks():
                compute = self.compute[:, cols] if self.compute is not None else None
                chunk = (self.params[:, cols], self.exp_avg[:, cols], self.exp_avg_sq[:, cols], self.grads[:, cols])
                _adamw_update(*chunk, compute, *scalars)
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


# Static-shape kernels broadcast the per-slot scalars along rows of a known width; a dynamic-shape kernel
# pays a 64-bit division per element for it (~2x slower here). torch._dynamo recompiles one function at
# most 8 times and then runs it eagerly (on the whole store, with full-size temporaries), so after a few
# store shapes one dynamic-shape kernel serves all the others.
_STATIC_SHAPES_MAX = 6
_static_shapes: set[tuple[int, ...]] = set()


def _compiled_update(shape: tuple[int, ...]) -> Callable[..., None]:
    """The compiled ``_adamw_update`` for a store of ``shape`` (compiled on its first call)."""
    if shape in _static_shapes or len(_static_shapes) < _STATIC_SHAPES_MAX:
        _static_shapes.add(shape)
        return _static_kernel()
    return _dynamic_kernel()


@functools.cache
def _static_kernel() -> Callable[..., None]:
    return torch.compile(_adamw_update, dynamic=False)


def _adamw_update_any_shape(*args: Any) -> None:
    """``_adamw_update`` under another code object, so its compiled variants are cached apart."""
    _adamw_update(*args)


@functools.cache
def _dynamic_kernel() -> Callable[..., None]:
    return torch.compile(_adamw_update_any_shape, dynamic=True)
