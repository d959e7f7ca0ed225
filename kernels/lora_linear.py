"""A LoRA-wrapped linear layer of a pack as one op: ``y = x Wᵀ + b + scale_z · B_z A_z dropout_z(x)`` per token.

Two backends behind one function:

- ``"triton"`` (``kernels.triton_lora``): the frozen GEMM and the LoRA path in three kernels forward and
  four backward, the expand added inside the GEMM (CUDA, bf16/fp16/fp32);
- ``"torch"``: ``F.linear`` then ``kernels.lora_delta`` (any device; the reference the tests compare with).

``"auto"`` (the default) takes Triton for CUDA tensors when Triton imports, else torch. The environment
variable ``LORAPLANE_LORA_BACKEND`` (auto / torch / triton) or ``set_backend`` overrides it, so a benchmark
can time both in one process.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import torch
import torch.nn.functional as F

from kernels.dropout import LayerDropout
from kernels.lora_delta import lora_delta
from kernels.segments import SegmentMeta

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")
_backend: list[Backend] = ["auto"]


def set_backend(backend: Backend) -> None:
    """Choose the backend of every later ``lora_linear`` call in this process."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown LoRA backend {backend!r}; choose one of {_BACKENDS}")
    _backend[0] = backend


def get_backend() -> Backend:
    return _backend[0]


@functools.cache
def triton_available() -> bool:
    """Whether ``kernels.triton_lora`` imports (Triton installed and working)."""
    try:
        import kernels.triton_lora  # noqa: F401
    except Exception as exc:  # ImportError, or a Triton that fails at import on this machine
        logger.info("Triton LoRA kernels unavailable (%s): the torch path runs", exc)
        return False
    return True


def resolve_backend(x: torch.Tensor) -> Literal["torch", "triton"]:
    """The backend a call with activations ``x`` takes."""
    chosen = _backend[0]
    if chosen == "torch":
        return "torch"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    supported = x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    usable = (x.is_cuda or interpret) and supported and triton_available()
    if chosen == "triton":
        if not usable:
            raise RuntimeError(f"the Triton LoRA backend cannot run on {x.device} {x.dtype} here")
        return "triton"
    return "triton" if usable and x.is_cuda else "torch"


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    meta: SegmentMeta,
    dropout: LayerDropout | None = None,
    grad_a: torch.Tensor | None = None,
    grad_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """The frozen layer's output plus every token's own slot's LoRA output.

    Args:
        x: ``(tokens, d_in)``.
        weight: ``(d_out, d_in)`` frozen (receives no gradient). bias: ``(d_out,)`` or ``None``.
        lora_a, lora_b, scale, meta, dropout, grad_a, grad_b: as in ``kernels.lora_delta``.

    Returns:
        ``(tokens, d_out)`` in x's dtype.
    """
    if resolve_backend(x) == "triton":
        from kernels.triton_lora import LoraLinearFunction

        if meta.num_segments == 0 or x.shape[0] == 0:
            return F.linear(x, weight, bias)
        out: torch.Tensor = LoraLinearFunction.apply(
            x, weight, bias, lora_a, lora_b, scale, meta, dropout, grad_a, grad_b
        )
        return out
    base = F.linear(x, weight, bias)
    return lora_delta(x, lora_a, lora_b, scale, meta, dropout, base, grad_a, grad_b)


_env = os.environ.get("LORAPLANE_LORA_BACKEND", "auto")
set_backend(_env if _env in _BACKENDS else "auto")  # type: ignore[arg-type]
