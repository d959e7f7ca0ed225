"""A LoRA-wrapped linear layer of a pack as one op: ``y = x Wᵀ + b + scale_z · B_z A_z dropout_z(x)`` per token.

Two backends behind one function:

- ``"triton"`` (``kernels.triton_lora``): the frozen GEMM and the LoRA path in three kernels forward and
  four backward, the expand added inside the GEMM (CUDA, bf16/fp16/fp32);
- ``"torch"``: ``F.linear`` then ``kernels.lora_delta`` (any device; the reference the tests compare with).

``"auto"`` (the default) takes Triton for CUDA tensors when Triton imports and the layer is one where Triton
was measured faster (``auto_backend``), else torch. The environment variable ``LORAPLANE_LORA_BACKEND``
(auto / torch / triton) or ``set_backend`` overrides it, so a benchmark can time both in one process.
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


# Where Triton beat the torch path, engine tokens/s on an H100 (benchmarks/results/engine_throughput-*-gpu-2026112*):
# Llama-3.2-1B shape (d_in 2048), 32 slots: +5% at batch 1, +6% at batch 4 (-30% at batch 2); Llama-3.1-8B shape,
# 8 slots: -6%; SmolLM2-135M shape (d_in 576/1536), 24 slots: -21 to -27% (there the step is host-bound, and each
# Triton launch costs ~0.1 ms of Python: 840 a step). So Triton only for wide layers with many slots.
# A rank of a pack over several GPUs is another case (``uncaptured``): its steps are never replayed from CUDA graphs
# (worker/engine/capture.py: the layers' all-gathers are collectives), and the torch path then launches ~2.3x the
# kernels Triton does. On two H200s, Llama-3.1-8B shape, 8 slots a rank, batch 1, the pack over both GPUs went from
# 0.91x to 1.08x one GPU's tokens/s with Triton on the ranks, and from 1.02x to 1.29x with the base whole on each
# (benchmarks/results/issue37/, docs/multi-gpu.md). So on such a rank Triton for every wide layer.
AUTO_TRITON_MIN_D_IN = 2048
AUTO_TRITON_MIN_SLOTS = 16


def auto_backend(d_in: int, slots: int, *, uncaptured: bool = False) -> Literal["torch", "triton"]:
    """What ``"auto"`` picks on a GPU for a layer of input width ``d_in`` in a pack of ``slots`` slots
    (``uncaptured``: the pack's steps never run from CUDA graphs, as on a rank of a pack over several GPUs)."""
    wide = d_in >= AUTO_TRITON_MIN_D_IN
    return "triton" if wide and (uncaptured or slots >= AUTO_TRITON_MIN_SLOTS) else "torch"


def resolve_backend(x: torch.Tensor, slots: int | None = None, *,
                    uncaptured: bool = False) -> Literal["torch", "triton"]:
    """The backend a call with activations ``x`` (``(tokens, d_in)``) in a pack of ``slots`` slots takes
    (``uncaptured``: as in ``auto_backend``)."""
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
    if not (usable and x.is_cuda):
        return "torch"
    return "triton" if slots is None else auto_backend(int(x.shape[-1]), slots, uncaptured=uncaptured)


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
    uncaptured: bool = False,
) -> torch.Tensor:
    """The frozen layer's output plus every token's own slot's LoRA output.

    Args:
        x: ``(tokens, d_in)``.
        weight: ``(d_out, d_in)`` frozen (receives no gradient). bias: ``(d_out,)`` or ``None``.
        lora_a, lora_b, scale, meta, dropout, grad_a, grad_b: as in ``kernels.lora_delta``.
        uncaptured: the pack's steps never run from CUDA graphs (``auto_backend``).

    Returns:
        ``(tokens, d_out)`` in x's dtype.
    """
    # A quantised weight (a tensor subclass, a 4-bit base: worker/engine/quantize.py) de-quantises itself in
    # F.linear; the Triton kernel reads plain weights only, so its LoRA delta takes the torch path.
    quantized = type(weight) not in (torch.Tensor, torch.nn.Parameter)
    if not quantized and resolve_backend(x, slots=lora_a.shape[0], uncaptured=uncaptured) == "triton":
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
