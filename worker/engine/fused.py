"""Fused kernels for the frozen base's non-GEMM work on CUDA: RMSNorm, SwiGLU and RoPE from Liger-Kernel.

In an eager HF decoder layer each of these is several elementwise kernels with a tensor written to memory
between each (the H100 profile of the 1B shape spent 115 of 249 device-ms per step in elementwise kernels
and copies). Liger-Kernel's Triton functions do each in one kernel forward and one backward.

They are put on one model while a ``PackEngine`` holds it, and taken off by ``unfuse`` (the bare model is
exactly HF's again):

- ``rmsnorm``: every Llama-style RMSNorm module (``weight * x / rms(x)``, the weight not offset) gets an
  instance ``forward`` calling ``liger_rms_norm`` (not in place: a residual stream shares its gradient);
- ``swiglu``: every gated MLP with ``gate_proj`` / ``up_proj`` / ``down_proj`` and a SiLU activation gets
  one that multiplies ``silu(gate) * up`` in one kernel (the projections, LoRA-wrapped or not, run as before);
- ``rope``: the architecture module's ``apply_rotary_pos_emb`` is swapped for ``liger_rope`` (a module-level
  function: it is swapped for the architecture while the engine holds the model, for the families below).

CPU and fp32 tests run HF's own code (the exact path); ``LORAPLANE_FUSED_OPS`` (``all``, ``none`` or a
comma list of the names above) chooses, so a benchmark can measure each piece's share.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.engine.lora import override_forward, restore_forwards

logger = logging.getLogger(__name__)

FUSED_OPS = ("rmsnorm", "swiglu", "rope")
FUSED_MARK = "_loraplane_fused"  # set on a module whose forward fuse() replaced (an instance attribute)
FUSED_ROPE = "_loraplane_fused_rope"  # on the model: (its architecture's module, the RoPE function fuse() swapped)
# Families whose RMSNorm, MLP and apply_rotary_pos_emb are Llama's (checked by class name and module).
ROPE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
RMSNORM_CLASSES = tuple(f"{name}RMSNorm" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Phi3"))


def chosen_ops() -> tuple[str, ...]:
    """The fused ops ``LORAPLANE_FUSED_OPS`` selects (``all`` by default).

    Raises:
        ValueError: a name that is not one of ``FUSED_OPS``.
    """
    value = os.environ.get("LORAPLANE_FUSED_OPS", "all").strip()
    if value == "all":
        return FUSED_OPS
    if value in ("", "none"):
        return ()
    names = tuple(name.strip() for name in value.split(","))
    unknown = sorted(set(names) - set(FUSED_OPS))
    if unknown:
        raise ValueError(f"LORAPLANE_FUSED_OPS: unknown {unknown}; choose from {FUSED_OPS}, 'all' or 'none'")
    return names


@dataclass(frozen=True)
class FusedKernels:
    """The functions ``fuse`` puts in the base's forwards, with Liger-Kernel's signatures: ``rms_norm(x, weight,
    eps, offset, casting_mode, in_place)``, ``swiglu(gate, up)`` and ``rope(q, k, cos, sin)`` (HF's
    ``apply_rotary_pos_emb``'s)."""

    rms_norm: Callable[..., torch.Tensor]
    swiglu: Callable[..., torch.Tensor]
    rope: Callable[..., Any]


def liger_kernels() -> FusedKernels | None:
    """Liger-Kernel's Triton functions, or None where it does not import (not installed, or a Triton that does not
    work here)."""
    try:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu
    except Exception as exc:
        logger.warning("Liger-Kernel unavailable (%s): the base model's norms and MLPs run unfused", exc)
        return None
    return FusedKernels(rms_norm=liger_rms_norm, swiglu=liger_swiglu, rope=liger_rope)


def fuse(model: nn.Module, ops: tuple[str, ...] | None = None, kernels: FusedKernels | None = None) -> list[str]:
    """Put the fused kernels ``ops`` (default ``chosen_ops()``) on ``model``; returns what was fused.

    ``kernels`` default to Liger-Kernel's, only on CUDA in bf16/fp16 and where it imports; elsewhere nothing
    changes. A test passes torch functions of the same signatures to run the forwards ``fuse`` sets on the CPU
    (tests/engine/test_distributed.py: under FSDP2).
    """
    ops = chosen_ops() if ops is None else ops
    if not ops:
        return []
    if kernels is None:
        parameter = next(model.parameters())
        if not parameter.is_cuda or parameter.dtype not in (torch.bfloat16, torch.float16):
            return []
        kernels = liger_kernels()
        if kernels is None:
            return []
    rms_norm, swiglu = kernels.rms_norm, kernels.swiglu
    done = []
    if "rmsnorm" in ops and _replace_forwards(model, _is_rmsnorm, lambda m: _rmsnorm_forward(m, rms_norm)):
        done.append("rmsnorm")
    if "swiglu" in ops and _replace_forwards(model, _is_swiglu_mlp, lambda m: _swiglu_forward(m, swiglu)):
        done.append("swiglu")
    if "rope" in ops:
        module = _family_module(model)
        if module is not None and callable(getattr(module, "apply_rotary_pos_emb", None)):
            setattr(model, FUSED_ROPE, (module, module.apply_rotary_pos_emb))
            module.apply_rotary_pos_emb = kernels.rope
            done.append("rope")
    return done


def unfuse(model: nn.Module) -> None:
    """Undo ``fuse``: the modules' own forwards and the architecture's RoPE function are back."""
    restore_forwards(model, FUSED_MARK)
    rope = getattr(model, FUSED_ROPE, None)
    if rope is not None:
        family, original = rope
        family.apply_rotary_pos_emb = original
        delattr(model, FUSED_ROPE)


def _replace_forwards(
    model: nn.Module, wanted: Callable[[nn.Module], bool], make: Callable[[nn.Module], Callable[..., Any]]
) -> bool:
    found = False
    for module in model.modules():
        if wanted(module) and not getattr(module, FUSED_MARK, False):
            override_forward(module, make(module), FUSED_MARK)
            found = True
    return found


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__ in RMSNORM_CLASSES and hasattr(module, "variance_epsilon")


def _rmsnorm_forward(module: nn.Module, rms_norm: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    eps = float(getattr(module, "variance_epsilon"))  # noqa: B009 (an nn.Module attribute)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        # The weight is looked up per call, never kept from fuse time: in a layer sharded by FSDP2
        # (worker/engine/distributed.py) the module's ``weight`` between passes is the sharded DTensor, and FSDP2
        # sets the gathered whole weight on the module only for the layer's forward and backward. A kernel handed
        # the kept shard read past its end on two GPUs (issue 37: illegal memory access at the first step).
        return rms_norm(hidden_states, module.weight, eps, 0.0, "llama", False)

    return forward


def _is_swiglu_mlp(module: nn.Module) -> bool:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return act in ("silu", "swish") and all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))


def _swiglu_forward(module: nn.Module, swiglu: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        # Looked up per call: the projections may be wrapped in LoRA layers after this forward was set.
        gate, up, down = (getattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))
        return down(swiglu(gate(x), up(x)))

    return forward


def _family_module(model: nn.Module) -> Any:
    """The ``transformers.models.<family>.modeling_<family>`` module of a model of the families above."""
    name = type(model).__module__
    family = name.rsplit(".", 1)[-1].removeprefix("modeling_")
    return sys.modules.get(name) if family in ROPE_FAMILIES else None
