"""Stacked multi-LoRA linear layers: one frozen ``nn.Linear`` shared by the adapters of every slot.

Semantics per token ``n`` of slot ``z`` (PEFT's LoRA, Hu et al. 2021, https://arxiv.org/abs/2106.09685)::

    y[n] = W x[n] + scale_z * B_z(A_z(dropout_z(x[n])))      scale_z = alpha/r (rsLoRA: alpha/sqrt(r))

Every slot's adapter lives stacked, ``A: (Z, d_in, r_max)`` and ``B: (Z, r_max, d_out)``, as views into
one flat store (``store.AdapterStore``). Layers never compute indices: each forward reads the step's
``TokenRouting`` (built once on the host, vLLM style) from the ``LoraContext`` that every layer of the
model shares, and calls ``kernels.lora_linear`` (Triton kernels on CUDA, ``lora_delta`` on CPU).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import DropoutKeys, LayerDropout, SegmentMeta, lora_linear, mix32

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraConfig:
    """Hyperparameters of one adapter."""

    rank: int
    alpha: float
    dropout: float
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """``alpha / r``, or rsLoRA's ``alpha / sqrt(r)`` (Kalajdzievski 2023, https://arxiv.org/abs/2312.03732)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


@dataclass(frozen=True)
class TokenRouting:
    """What every LoRA layer of one forward needs: token -> slot segments, and dropout keys or ``None``."""

    meta: SegmentMeta
    dropout: DropoutKeys | None = None


@dataclass
class LoraContext:
    """Shared by all ``StackedLoraLinear`` of one model. ``routing is None``: layers run the bare base.
    ``uncaptured``: the pack's steps never run from CUDA graphs (a rank of a pack over several GPUs), which
    changes the LoRA path ``auto`` takes (kernels/lora_linear.py's ``auto_backend``)."""

    routing: TokenRouting | None = None
    uncaptured: bool = False

    @contextmanager
    def routed(self, routing: TokenRouting | None) -> Iterator[None]:
        """Route the forwards inside the block by ``routing``, then put the previous routing back."""
        previous, self.routing = self.routing, routing
        try:
            yield
        finally:
            self.routing = previous


class StackedLoraLinear(nn.Module):
    """A frozen linear layer plus every slot's LoRA adapter, stacked along the slot axis.

    The stacked weights are attached by ``AdapterStore``: ``lora_a (Z, d_in, r_max)``, ``lora_b (Z, r_max,
    d_out)``, their gradients' places ``grad_a`` / ``grad_b`` in the store, and ``scale (Z,)`` (0 for slots
    that do not target this layer). ``enabled`` is False while no admitted slot targets the layer, which
    then costs nothing beyond the base GEMM.

    Args:
        base_layer: the frozen layer, kept as ``self.base_layer`` (PEFT's attribute name).
        context: the model-wide ``LoraContext``.
        path: the layer's module path; it keys the layer's dropout masks, so they do not depend on which
            other layers the pack wraps.

    Shapes: input ``(..., d_in)``, output ``(..., d_out)``.
    """

    def __init__(self, base_layer: nn.Linear, context: LoraContext, path: str) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.context = context
        self.path = path
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.grad_a: torch.Tensor | None = None
        self.grad_b: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.enabled = False
        layer_key = mix32(zlib.crc32(path.encode()))
        features = torch.arange(base_layer.in_features, dtype=torch.int64, device=base_layer.weight.device)
        self.feature_keys = mix32(features ^ layer_key)  # (d_in,) int64

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.context.routing
        if routing is None or not self.enabled:
            return self.base_layer(x)
        assert self.lora_a is not None and self.lora_b is not None and self.scale is not None
        flat = x.reshape(-1, self.in_features)  # (tokens, d_in), row-major (batch, seq) order
        dropout = None if routing.dropout is None else LayerDropout(routing.dropout, self.feature_keys)
        base = self.base_layer
        out = lora_linear(
            flat, base.weight, base.bias, self.lora_a, self.lora_b, self.scale, routing.meta, dropout,
            self.grad_a, self.grad_b, uncaptured=self.context.uncaptured,
        )  # fmt: skip
        return out.view(*x.shape[:-1], self.out_features)


def inject_lora(model: nn.Module, paths: list[str], context: LoraContext) -> list[StackedLoraLinear]:
    """Wrap the linear layers at ``paths`` in ``StackedLoraLinear``; returns the wrappers in model order.

    Raises:
        ValueError: the model already has LoRA layers (one pack per model at a time), or a path that
            is not an ``nn.Linear``.
    """
    if any(isinstance(m, StackedLoraLinear) for m in model.modules()):
        raise ValueError("the model already has LoRA layers: restore_base_model() it first")
    linears = _linear_layers(model)
    missing = set(paths) - set(linears)
    if missing:
        raise ValueError(f"not linear layers of {type(model).__name__}: {sorted(missing)}")
    layers = []
    for path in [p for p in linears if p in set(paths)]:
        layer = StackedLoraLinear(linears[path], context, path)
        _set_submodule(model, path, layer)
        layers.append(layer)
    return layers


# Set on a decoder layer whose forward recompute.enable_recompute replaced (an instance attribute).
RECOMPUTE_MARK = "_loraplane_recompute"


def override_forward(module: nn.Module, forward: Callable[..., Any], mark: str) -> None:
    """Give ``module`` an instance ``forward`` (the class's stays underneath), marked ``mark`` for
    ``restore_forwards``."""
    module.forward = forward
    setattr(module, mark, True)


def restore_forwards(model: nn.Module, mark: str) -> None:
    """Drop every instance ``forward`` that ``override_forward`` set under ``mark``."""
    for module in model.modules():
        if getattr(module, mark, False):
            del module.forward  # the instance attribute: the class's forward shows through again
            delattr(module, mark)


def restore_base_model(model: nn.Module) -> None:
    """Unwrap every ``StackedLoraLinear`` and undo activation checkpointing: the model is exactly the
    frozen base model again."""
    restore_forwards(model, RECOMPUTE_MARK)
    wrapped = [(p, m) for p, m in model.named_modules() if isinstance(m, StackedLoraLinear)]
    for path, module in wrapped:
        _set_submodule(model, path, module.base_layer)


def resolve_target_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    """Module paths of the linear layers that ``patterns`` select, in model order.

    A pattern selects a layer whose path equals it or ends with ``"." + pattern`` (PEFT's rule);
    ``"all-linear"`` selects every linear layer except the output embedding (``lm_head``).

    Raises:
        ValueError: no patterns, or a pattern that selects no linear layer.
    """
    if not patterns:
        raise ValueError("target_modules is empty")
    linears = _linear_layers(model)
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if isinstance(output, StackedLoraLinear):
        output = output.base_layer
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            hits = {p for p, m in linears.items() if m is not output}
        else:
            hits = {p for p in linears if p == pattern or p.endswith("." + pattern)}
        if not hits:
            examples = sorted({p.rsplit(".", 1)[-1] for p in linears})
            raise ValueError(
                f"target module {pattern!r} matches no linear layer of {type(model).__name__}; "
                f"linear layer names: {examples}"
            )
        chosen |= hits
    return [p for p in linears if p in chosen]


def peft_target_modules(model: nn.Module, module_paths: list[str]) -> list[str]:
    """The ``target_modules`` to write into ``adapter_config.json`` for layers ``module_paths``.

    Leaf names (``["q_proj", "v_proj"]``) when, under PEFT's suffix rule, they select exactly these
    layers; otherwise the full paths, which PEFT matches exactly.
    """
    leaves = sorted({p.rsplit(".", 1)[-1] for p in module_paths})
    selected = {p for p in _linear_layers(model) if any(p == leaf or p.endswith("." + leaf) for leaf in leaves)}
    return leaves if selected == set(module_paths) else sorted(module_paths)


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """``{path: frozen linear}`` in model order, seeing through ``StackedLoraLinear`` wrappers."""
    layers: dict[str, nn.Linear] = {}
    for path, module in model.named_modules():
        if isinstance(module, StackedLoraLinear):
            layers[path] = module.base_layer
        elif isinstance(module, nn.Linear) and not path.endswith(".base_layer"):
            layers[path] = module
    return layers


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)
