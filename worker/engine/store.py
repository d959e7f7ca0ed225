"""Every slot's adapter of every wrapped layer in one flat fp32 matrix ``(Z, P)``: init, clear, read, write.

Row ``z`` holds slot ``z``'s adapters of all layers, laid out rank by rank: for rank index ``j = 0 .. r_max-1``
a *rank row* of width ``W = Σ_m (d_in_m + d_out_m)`` holding, layer after layer, column ``j`` of ``A_m`` (d_in_m
values) and row ``j`` of ``B_m`` (d_out_m values); ``P = r_max · W``. A slot of rank ``r`` therefore uses
exactly the first ``r · W`` columns of its row (``live_columns``), and the optimizer updates only those:
the rank padding of a pack of mixed ranks costs no optimizer traffic. Each layer's stacked
``A: (Z, d_in, r_max)`` and ``B: (Z, r_max, d_out)`` are strided views (strides ``(P, 1, W)`` and ``(P, W, 1)``),
so the optimizer and gradient clipping are a handful of ops over ``(Z, P)`` and never a loop over slots or
layers.

Gradients reach the store without autograd bookkeeping per layer: each layer gets its place in ``grads``
(``grad_a`` / ``grad_b``, strided views) and ``kernels.lora_delta``'s backward adds dA and dB there itself,
in the GEMM epilogue where it can. The layers' ``A`` / ``B`` are views of ``compute`` marked as requiring
grad only so that autograd records the LoRA path even where the activations need no gradient (the first
layer's, under a frozen embedding).
On CUDA ``compute`` is a bf16 copy of the fp32 ``weights``, refreshed once per step by the optimizer's
update (not once per layer); on CPU it is ``weights`` itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from worker.engine.lora import StackedLoraLinear

ModuleTensors = dict[str, tuple[torch.Tensor, torch.Tensor]]  # {path: (A (r, d_in), B (d_out, r))}, PEFT layout


@dataclass(frozen=True)
class _Block:
    """Where one layer's adapters sit in each rank row of a slot's row."""

    layer: StackedLoraLinear
    a_offset: int  # column j of A starts at j * W + a_offset
    b_offset: int  # row j of B starts at j * W + b_offset

    @property
    def a_size(self) -> int:
        return self.layer.in_features

    @property
    def b_size(self) -> int:
        return self.layer.out_features


def slot_bytes(dims: list[tuple[int, int]], max_rank: int, compute_dtype: torch.dtype) -> int:
    """Device bytes one slot of an ``AdapterStore`` takes: its row of the fp32 weights, of their compute copy
    (none in fp32), of the gradients (compute dtype) and of the optimizer's two fp32 moments, over layers of
    ``(d_in, d_out)`` ``dims`` at rank ``max_rank``."""
    params = max_rank * sum(d_in + d_out for d_in, d_out in dims)
    size = torch.empty((), dtype=compute_dtype).element_size()
    return params * (4 + (size if compute_dtype != torch.float32 else 0) + size + 4 + 4)


class AdapterStore:
    """Stacked adapters of ``capacity`` slots for ``layers``, rank-padded to ``max_rank``.

    Padded ranks stay exactly zero: they start at zero and ``kernels.lora_delta`` gives them zero gradient,
    so AdamW (decoupled decay of 0 is 0, an update from zero moments is 0) never moves them.

    Attributes:
        weights: ``(Z, P)`` float32 master copy, what the optimizer updates.
        compute: ``(Z, P)`` in the base model's dtype, what the layers read (``weights`` itself in fp32).
        grads: ``(Z, P)`` in the compute dtype; zeroed by the caller before each backward.
        scales: ``(layers, Z)`` float32; row ``m`` is layer ``m``'s ``scale``.
    """

    def __init__(
        self,
        layers: list[StackedLoraLinear],
        *,
        capacity: int,
        max_rank: int,
        device: torch.device,
        compute_dtype: torch.dtype,
    ) -> None:
        if capacity < 1 or max_rank < 1:
            raise ValueError(f"need capacity >= 1 and max_rank >= 1, got {capacity} and {max_rank}")
        self.capacity, self.max_rank = capacity, max_rank
        self.blocks: list[_Block] = []
        offset = 0
        for layer in layers:
            self.blocks.append(_Block(layer, offset, offset + layer.in_features))
            offset += layer.in_features + layer.out_features
        self.rank_width = offset  # W
        self.index = {block.layer.path: i for i, block in enumerate(self.blocks)}
        self.weights = torch.zeros(capacity, max_rank * offset, dtype=torch.float32, device=device)
        self.compute = self.weights if compute_dtype == torch.float32 else self.weights.to(compute_dtype)
        self.grads = torch.zeros_like(self.weights, dtype=compute_dtype)
        self.scales = torch.zeros(len(layers), capacity, dtype=torch.float32, device=device)
        self.ranks: list[int] = [0] * capacity
        self.targets: list[list[int]] = [[] for _ in range(capacity)]  # layer indices each slot targets
        for i, block in enumerate(self.blocks):
            layer = block.layer
            layer.lora_a = self._stacked_a(self.compute, block).requires_grad_(True)
            layer.lora_b = self._stacked_b(self.compute, block).requires_grad_(True)
            layer.grad_a, layer.grad_b = self._stacked_a(self.grads, block), self._stacked_b(self.grads, block)
            layer.scale = self.scales[i]

    def _stacked_a(self, matrix: torch.Tensor, block: _Block) -> torch.Tensor:
        """``(Z, d_in, r_max)`` view of one layer's A in a ``(Z, P)`` matrix laid out like ``weights``."""
        z, width = matrix.shape
        size, stride = (z, block.a_size, self.max_rank), (width, 1, self.rank_width)
        return matrix.as_strided(size, stride, matrix.storage_offset() + block.a_offset)

    def _stacked_b(self, matrix: torch.Tensor, block: _Block) -> torch.Tensor:
        """``(Z, r_max, d_out)`` view of one layer's B."""
        z, width = matrix.shape
        size, stride = (z, self.max_rank, block.b_size), (width, self.rank_width, 1)
        return matrix.as_strided(size, stride, matrix.storage_offset() + block.b_offset)

    def live_columns(self, slot: int) -> int:
        """How much of ``slot``'s row its rank uses: the rest is padding, always zero (0 for a free slot)."""
        return self.ranks[slot] * self.rank_width

    def init_slot(self, slot: int, *, paths: list[str], rank: int, scale: float, seed: int) -> None:
        """Fresh adapter for ``slot`` on layers ``paths``: A kaiming-uniform(a=sqrt 5) as PEFT, B zero.

        A is drawn as ``(rank, d_in)``, like ``nn.Linear`` / PEFT, from a CPU generator seeded with
        ``seed``, layer by layer in model order: the init depends on neither the slot nor the pack.
        """
        generator = torch.Generator().manual_seed(seed)
        tensors: ModuleTensors = {}
        for path in self._ordered(paths):
            block = self.blocks[self.index[path]]
            lora_a = torch.empty(rank, block.a_size)
            nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
            tensors[path] = (lora_a, torch.zeros(block.b_size, rank))
        self.load_slot(slot, tensors, rank=rank, scale=scale)

    def load_slot(self, slot: int, tensors: ModuleTensors, *, rank: int, scale: float) -> None:
        """Install ``{path: (A (r, d_in), B (d_out, r))}`` as ``slot``'s adapter (copied; other layers zero).

        Raises:
            ValueError: a rank above ``max_rank``, an unknown path or a tensor of the wrong shape.
        """
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"rank {rank} outside [1, {self.max_rank}] (the pack's max rank)")
        unknown = sorted(set(tensors) - set(self.index))
        if unknown:
            raise ValueError(f"layers not wrapped in this pack: {unknown}")
        self.clear_slot(slot)
        self.write(self.weights, slot, tensors)
        self.ranks[slot] = rank
        self.targets[slot] = sorted(self.index[p] for p in tensors)
        self.scales[self.targets[slot], slot] = scale
        self._sync_compute(slot)
        self._update_enabled()

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot``'s adapter, gradient and scales; no layer computes for it any more."""
        self.weights[slot].zero_()
        self.grads[slot].zero_()
        self.scales[:, slot] = 0.0
        self.ranks[slot], self.targets[slot] = 0, []
        self._sync_compute(slot)
        self._update_enabled()

    def paths(self, slot: int) -> list[str]:
        """Layers ``slot`` targets, in model order."""
        return [self.blocks[i].layer.path for i in self.targets[slot]]

    def read(self, matrix: torch.Tensor, slot: int) -> ModuleTensors:
        """Clones of ``slot``'s true-rank ``{path: (A (r, d_in), B (d_out, r))}`` from a ``(Z, P)`` matrix.

        ``matrix`` is ``weights`` or anything laid out like it (the optimizer's moments).
        """
        rank, out = self.ranks[slot], {}
        for i in self.targets[slot]:
            block = self.blocks[i]
            a, b = self._stacked_a(matrix, block)[slot], self._stacked_b(matrix, block)[slot]
            out[block.layer.path] = (a[:, :rank].T.clone(), b[:rank].T.clone())
        return out

    @torch.no_grad()
    def write(self, matrix: torch.Tensor, slot: int, tensors: ModuleTensors) -> None:
        """Copy ``{path: (A (r, d_in), B (d_out, r))}`` into ``slot``'s row of ``matrix``; padding untouched."""
        for path, (lora_a, lora_b) in tensors.items():
            block = self.blocks[self.index[path]]
            rank = lora_a.shape[0]
            if lora_a.shape != (rank, block.a_size) or lora_b.shape != (block.b_size, rank):
                raise ValueError(
                    f"{path}: A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit "
                    f"(r, {block.a_size}) / ({block.b_size}, r)"
                )
            a, b = self._stacked_a(matrix, block)[slot], self._stacked_b(matrix, block)[slot]
            a[:, :rank].copy_(lora_a.T)
            b[:rank].copy_(lora_b.T)

    @torch.no_grad()
    def install(self, slot: int, tensors: ModuleTensors) -> None:
        """Make ``tensors`` (the slot's own layers and rank: its best adapter, say) the slot's current weights;
        its optimizer state, gradient and scales are left as they are."""
        self.write(self.weights, slot, tensors)
        self._sync_compute(slot)

    def _sync_compute(self, slot: int) -> None:
        if self.compute is not self.weights:
            self.compute[slot].copy_(self.weights[slot])

    def _update_enabled(self) -> None:
        """A layer computes its LoRA path only while some slot targets it (host bookkeeping, no sync)."""
        targeted = {i for targets in self.targets for i in targets}
        for i, block in enumerate(self.blocks):
            block.layer.enabled = i in targeted

    def _ordered(self, paths: list[str]) -> list[str]:
        unknown = sorted(set(paths) - set(self.index))
        if unknown:
            raise ValueError(f"layers not wrapped in this pack: {unknown}")
        return sorted(paths, key=self.index.__getitem__)
