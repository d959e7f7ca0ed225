"""Counter-based dropout masks: a pure function of integer keys, no RNG state.

A mask element is ``hash(token key, feature key) >= threshold``. The engine derives the token key from
(trial seed, the trial's own step, the token's position in the trial's own micro-batch) and the feature
key from (layer, feature index), so a trial draws the same masks whether it trains alone or in any pack,
and a resumed trial needs no RNG state to continue bit for bit. All arithmetic is int64 on values below
2**32 with multipliers below 2**31, so no product reaches 2**63 and nothing relies on overflow.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

MASK32 = 0xFFFF_FFFF
# The [16 21f0aaad 15 735a2d97 15] low-bias 32-bit mixer found with hash-prospector
# (https://github.com/skeeto/hash-prospector); both multipliers are below 2**31.
_M1, _M2 = 0x21F0AAAD, 0x735A2D97

IntLike = TypeVar("IntLike", int, torch.Tensor)


def mix32(x: IntLike) -> IntLike:
    """A 32-bit integer mix (bijective on ``[0, 2**32)``), for Python ints or int64 tensors.

    Args:
        x: values in ``[0, 2**32)``.

    Returns:
        Values in ``[0, 2**32)``, same type (and shape) as ``x``.
    """
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 15)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` in place on a large int64 tensor: two live buffers instead of one per operation."""
    x.bitwise_xor_(x >> 16).mul_(_M1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15).mul_(_M2).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 15)


def keep_threshold(p: float) -> int:
    """Hash values ``>= keep_threshold(p)`` are kept: a fraction ``1 - p`` of uniform 32-bit values."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} outside [0, 1)")
    return round(p * 2**32)


@dataclass(frozen=True)
class DropoutKeys:
    """Per-token dropout keys of one forward; every tensor is ``(tokens,)``."""

    token_keys: torch.Tensor  # int64 in [0, 2**32): hash of (trial, trial step, position in its micro-batch)
    threshold: torch.Tensor  # int64, keep_threshold(p) of the token's slot
    inv_keep: torch.Tensor  # float32, 1 / (1 - p) of the token's slot


@dataclass(frozen=True)
class LayerDropout:
    """A forward's dropout keys plus one layer's ``(d_in,)`` int64 feature keys."""

    keys: DropoutKeys
    feature_keys: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x ⊙ K`` for ``x`` ``(tokens, d_in)``, where ``K[n, f] = (mix32(token_keys[n] ^ feature_keys[f]) >=
        threshold[n]) / (1 - p_n)``. K is never stored: backward applies the same function to the gradient.

        On CUDA the mask is one fused kernel (torch.compile, compiled once on first use): eagerly, the hash
        is ~12 passes over a ``(tokens, d_in)`` int64 tensor per layer, which would double a step's time.
        """
        k = self.keys
        kept = None
        if x.is_cuda and _compiled_ok[0]:
            try:
                kept = _compiled_kept()(k.token_keys, self.feature_keys, k.threshold)
            except Exception as exc:  # compiling failed, before anything ran: stay eager from now on
                logger.warning("compiled dropout mask failed (%s); using the eager one", exc)
                _compiled_ok[0] = False
        if kept is None:
            kept = _kept(k.token_keys, self.feature_keys, k.threshold)
        # The multiply stays eager: compiled, it could skip rounding 1 / (1 - p) to x's dtype.
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return torch.where(kept, x * k.inv_keep[:, None].to(x.dtype), zero)


def _kept(token_keys: torch.Tensor, feature_keys: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``(tokens, d_in)`` bool keep mask. Eager memory peak: two ``(tokens, d_in)`` int64 buffers."""
    return _mix32_(token_keys[:, None] ^ feature_keys[None, :]) >= threshold[:, None]


_compiled_ok = [True]


@functools.cache
def _compiled_kept() -> Callable[..., torch.Tensor]:
    # dynamic: the token count changes every step.
    return torch.compile(_kept, dynamic=True)
