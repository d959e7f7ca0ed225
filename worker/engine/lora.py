"""Multi-adapter LoRA layers: one frozen ``nn.Linear`` shared by the adapters of every slot of a pack.

Semantics per slot ``s`` (PEFT's, Hu et al. 2021, https://arxiv.org/abs/2106.09685)::

    y = W x + (alpha_s / r_s) * B_s(A_s(dropout_s(x)))      A_s: (r_s, in), B_s: (out, r_s)

This is the straightforward engine: one slot is active per forward. Layers read the active slot from an
``AdapterContext`` shared by all layers of the model (the per-step "mapping", as vLLM's punica wrapper
holds it), so a batched engine can replace the context and the layer without touching the trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraConfig:
    """Hyperparameters of one slot's adapter."""

    rank: int
    alpha: float
    dropout: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class AdapterContext:
    """State every ``MultiLoraLinear`` of one model reads on each forward.

    Attributes:
        slots: configuration of each live slot.
        active: the slot whose adapter applies to this forward; ``None`` runs the bare base model.
        training: apply LoRA dropout (the base model itself always stays in eval mode).
        dropout_generators: one RNG per slot, so a trial's dropout masks do not depend on which other
            trials share the pack.
    """

    slots: dict[int, LoraConfig] = field(default_factory=dict)
    active: int | None = None
    training: bool = False
    dropout_generators: dict[int, torch.Generator] = field(default_factory=dict)


class MultiLoraLinear(nn.Module):
    """A frozen linear layer plus one LoRA ``(A, B)`` pair per slot that targets it.

    Args:
        base_layer: the frozen layer, kept as ``self.base_layer`` (PEFT's attribute name).
        context: the model-wide ``AdapterContext``.

    Shapes: input ``(..., in_features)``, output ``(..., out_features)``.
    """

    def __init__(self, base_layer: nn.Linear, context: AdapterContext) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.context = context
        # Keys are str(slot): ParameterDict keys must be strings.
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()

    def add_slot(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
        """Install ``A: (r, in)`` and ``B: (out, r)`` for ``slot``, in fp32 on the base layer's device.

        fp32 even under a bf16 base, as PEFT's ``autocast_adapter_dtype``: AdamW updates of small LoRA
        weights are lost to bf16 rounding.
        """
        device = self.base_layer.weight.device
        a = nn.Parameter(lora_a.detach().to(device=device, dtype=torch.float32).clone())
        b = nn.Parameter(lora_b.detach().to(device=device, dtype=torch.float32).clone())
        self.lora_A[str(slot)], self.lora_B[str(slot)] = a, b
        return a, b

    def remove_slot(self, slot: int) -> None:
        if str(slot) in self.lora_A:
            del self.lora_A[str(slot)], self.lora_B[str(slot)]

    def has_slot(self, slot: int) -> bool:
        return str(slot) in self.lora_A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        slot = self.context.active
        if slot is None or str(slot) not in self.lora_A:
            return result
        config = self.context.slots[slot]
        lora_a, lora_b = self.lora_A[str(slot)], self.lora_B[str(slot)]
        h = x.to(lora_a.dtype)
        if self.context.training and config.dropout > 0:
            keep = torch.empty_like(h).bernoulli_(1 - config.dropout, generator=self.context.dropout_generators[slot])
            h = h * keep / (1 - config.dropout)
        # Add in fp32, then cast back: the same rounding as PEFT's LoRA Linear, so exported adapters
        # reproduce the engine's logits under a bf16 base too.
        return (result + F.linear(F.linear(h, lora_a), lora_b) * config.scale).to(result.dtype)


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
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            hits = {p for p, m in linears.items() if m is not output and not _wraps(m, output)}
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


def add_adapter(
    model: nn.Module,
    slot: int,
    config: LoraConfig,
    module_paths: list[str],
    *,
    init_seed: int,
    dropout_seed: int,
) -> list[nn.Parameter]:
    """Give ``slot`` a fresh adapter on ``module_paths``: A kaiming-uniform (as PEFT), B zero.

    Initialisation draws from a CPU generator seeded with ``init_seed`` in model order, so it does not
    depend on the device or on other slots. Linear layers are wrapped in ``MultiLoraLinear`` on first use.

    Returns:
        The new trainable parameters, ``[A_0, B_0, A_1, B_1, ...]``.
    """
    generator = torch.Generator().manual_seed(init_seed)
    linears = _linear_layers(model)
    tensors = {}
    for path in module_paths:
        base = linears[path]
        lora_a = torch.empty(config.rank, base.in_features)
        nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
        tensors[path] = (lora_a, torch.zeros(base.out_features, config.rank))
    return load_adapter(model, slot, config, tensors, dropout_seed=dropout_seed)


def load_adapter(
    model: nn.Module,
    slot: int,
    config: LoraConfig,
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    dropout_seed: int = 0,
) -> list[nn.Parameter]:
    """Install given ``{module path: (A (r, in), B (out, r))}`` as ``slot``'s adapter (copies them)."""
    context = adapter_context(model) or AdapterContext()
    if slot in context.slots:
        raise ValueError(f"slot {slot} is already in use")
    params: list[nn.Parameter] = []
    for path, (lora_a, lora_b) in tensors.items():
        params += _wrap(model, path, context).add_slot(slot, lora_a, lora_b)
    device = params[0].device if params else torch.device("cpu")
    context.slots[slot] = config
    context.dropout_generators[slot] = torch.Generator(device=device).manual_seed(dropout_seed)
    return params


def remove_adapter(model: nn.Module, slot: int) -> None:
    """Free ``slot``'s adapter; the layers stay wrapped for the other slots."""
    context = adapter_context(model)
    if context is None:
        return
    for module in model.modules():
        if isinstance(module, MultiLoraLinear):
            module.remove_slot(slot)
    context.slots.pop(slot, None)
    context.dropout_generators.pop(slot, None)
    if context.active == slot:
        context.active = None


def set_active_adapter(model: nn.Module, slot: int | None, *, training: bool = False) -> None:
    """Make ``slot``'s adapter apply to the following forwards (``None``: the bare base model)."""
    context = adapter_context(model)
    if context is None:
        if slot is not None:
            raise ValueError("model has no adapters")
        return
    if slot is not None and slot not in context.slots:
        raise ValueError(f"slot {slot} has no adapter")
    context.active, context.training = slot, training


def adapter_tensors(model: nn.Module, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Detached clones of ``slot``'s ``{module path: (A (r, in), B (out, r))}``, in model order."""
    return {
        path: (m.lora_A[str(slot)].detach().clone(), m.lora_B[str(slot)].detach().clone())
        for path, m in model.named_modules()
        if isinstance(m, MultiLoraLinear) and m.has_slot(slot)
    }


def restore_base_model(model: nn.Module) -> None:
    """Unwrap every ``MultiLoraLinear``: the model is exactly the frozen base model again."""
    wrapped = [(p, m) for p, m in model.named_modules() if isinstance(m, MultiLoraLinear)]
    for path, module in wrapped:
        _set_submodule(model, path, module.base_layer)


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """``{path: frozen linear}`` in model order, seeing through ``MultiLoraLinear`` wrappers."""
    layers: dict[str, nn.Linear] = {}
    for path, module in model.named_modules():
        if isinstance(module, MultiLoraLinear):
            layers[path] = module.base_layer
        elif isinstance(module, nn.Linear) and not path.endswith(".base_layer"):
            layers[path] = module
    return layers


def _wraps(module: nn.Module, other: nn.Module | None) -> bool:
    return isinstance(other, MultiLoraLinear) and other.base_layer is module


def adapter_context(model: nn.Module) -> AdapterContext | None:
    """The model's shared ``AdapterContext``, or ``None`` while no layer is wrapped."""
    for module in model.modules():
        if isinstance(module, MultiLoraLinear):
            return module.context
    return None


def _wrap(model: nn.Module, path: str, context: AdapterContext) -> MultiLoraLinear:
    module = model.get_submodule(path)
    if isinstance(module, MultiLoraLinear):
        return module
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{path} is a {type(module).__name__}, not nn.Linear")
    wrapper = MultiLoraLinear(module, context)
    _set_submodule(model, path, wrapper)
    return wrapper


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)
