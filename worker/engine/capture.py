"""Training steps replayed from CUDA graphs: on small models the eager step is bound by the host, not the GPU.

Measured on an H100 (``benchmarks/step_capture.py``, one fixed batch, 2026-11-24): a SmolLM2-135M pack of 24
trials × batch 4 steps in 256 ms eagerly while the GPU works 61 ms of it (~4,300 kernel launches, each with
its Python); the same forward and backward replayed from a graph take 61 ms. On the Llama-3.2-1B shape the
step is GPU-bound and a replay gains 2%.

How (design and alternatives: docs/step-capture.md):

- The engine packs each step's batch with static shapes (``pack_rows(static_shapes=True)``): every tensor's
  shape depends only on ``PackedBatch.shape_key()`` (token and target counts rounded up to a few buckets,
  one LoRA segment per slot whether it has tokens or not), and host values the kernels read are part of it.
- The first batch of each key (and set of layers with adapters) is captured after eager warm-up runs:
  its tensors become the graph's inputs. A later batch of the same key is copied into them, and the graph
  replays: the gradients' zeroing, the forward, the loss and the backward into the store, as one launch.
  The AdamW update stays outside (one kernel; its per-slot scalars change every step).
- All graphs of an engine share one memory pool (they never run at once); at most ``MAX_GRAPHS`` are kept, the
  least recently replayed making room for a new shape.

What runs captured: the torch LoRA path through ``torch._grouped_mm``, which reads the segments' offsets on
the device. The Triton kernels size their launch grids on the host from the segments, so a pack whose layers
take them steps eagerly; ``auto`` picks them only where the step is GPU-bound (``kernels.lora_linear``).
``LORAPLANE_STEP_CAPTURE``: ``auto`` (the default: capture where every layer takes the grouped torch path on
CUDA) or ``off``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.layouts import grouped_mm_supported, use_grouped_mm
from kernels.lora_linear import resolve_backend
from worker.engine.batch import PackedBatch
from worker.engine.lora import StackedLoraLinear

logger = logging.getLogger(__name__)

STEP_CAPTURE_MODES = ("auto", "off")
# Distinct batch shapes kept captured per engine, the least recently replayed evicted past it: a steady pack needs
# a few (token, target buckets), but an engine kept across packs (keeper.py) or one whose trials end and pause at
# rungs meets new shapes as its slots empty (16 were full within one early-exit task on an H200, 2026-11-26, and
# every later shape stepped eagerly until the eviction).
MAX_GRAPHS = 16  # the default of ``LORAPLANE_STEP_GRAPHS`` (max_graphs)
# Eager runs before a capture: kernels autotuned, libraries' lazy state built (the first capture of an engine),
# the new shape's autotuning (later ones).
FIRST_WARMUP_RUNS, WARMUP_RUNS = 2, 1


def capture_mode() -> str:
    """``LORAPLANE_STEP_CAPTURE`` (``auto`` by default).

    Raises:
        ValueError: a value that is not one of ``STEP_CAPTURE_MODES``.
    """
    mode = os.environ.get("LORAPLANE_STEP_CAPTURE", "auto").strip() or "auto"
    if mode not in STEP_CAPTURE_MODES:
        raise ValueError(f"LORAPLANE_STEP_CAPTURE={mode!r}: choose one of {STEP_CAPTURE_MODES}")
    return mode


def max_graphs() -> int:
    """``LORAPLANE_STEP_GRAPHS``: the distinct shapes an engine keeps captured (``MAX_GRAPHS`` by default). A
    service whose packs churn (many small tasks back-filled into one pack) meets more shapes than 16: the quality
    benchmark's 90 tasks on an H200 recaptured 487 times in 21 minutes, each at 16 kept (2026-11-27).

    Raises:
        ValueError: not an integer from 1 to 1024.
    """
    raw = os.environ.get("LORAPLANE_STEP_GRAPHS", "").strip()
    if not raw:
        return MAX_GRAPHS
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ValueError(f"LORAPLANE_STEP_GRAPHS={raw!r}: an integer from 1 to 1024")
    return int(raw)


def capturable(layers: list[StackedLoraLinear], *, capacity: int, max_rank: int, dtype: torch.dtype,
               device: torch.device) -> bool:  # fmt: skip
    """Whether a pack's steps can run from graphs: on CUDA, with every layer on the grouped torch path."""
    if device.type != "cuda" or capture_mode() == "off" or not use_grouped_mm():
        return False
    for layer in layers:
        probe = torch.empty(0, layer.in_features, dtype=dtype, device=device)
        if resolve_backend(probe, slots=capacity) != "torch":
            return False
        if not grouped_mm_supported(probe, (layer.in_features, max_rank, layer.out_features)):
            return False
    return True


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: PackedBatch  # the tensors the graph reads: each replay's batch is copied into them first
    losses: torch.Tensor  # (Z,) per-slot losses, written by each replay


class StepGraphs:
    """The captured forward+backward of one engine, one graph per batch shape.

    Args:
        forward_backward: the engine's eager ``batch -> (Z,) per-slot losses``, gradients added to ``grads``.
        grads: the store's gradients (zeroed inside the graph).
        layers: the pack's LoRA layers: which of them compute is part of a graph's shape.
    """

    def __init__(self, forward_backward: Callable[[PackedBatch], torch.Tensor], grads: torch.Tensor,
                 layers: list[StackedLoraLinear]) -> None:  # fmt: skip
        self._forward_backward, self._grads, self._layers = forward_backward, grads, layers
        self._graphs: OrderedDict[tuple[Any, ...], _Graph] = OrderedDict()  # least recently replayed first
        self._pool = torch.cuda.graph_pool_handle()
        self.enabled = True
        self.captures = 0
        self.replays = 0
        self.capture_s = 0.0  # wall time spent capturing (warm-up runs included), for the pack profile

    def run(self, batch: PackedBatch) -> torch.Tensor | None:
        """``(Z,)`` per-slot losses of ``batch`` (packed with static shapes), its gradients in ``grads``,
        from a graph; ``None`` when it must step eagerly (too many shapes, or capturing failed)."""
        if not self.enabled:
            return None
        key = batch.shape_key() + tuple(layer.enabled for layer in self._layers)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= max_graphs():  # the least recently replayed shape makes room (see MAX_GRAPHS)
                _, evicted = self._graphs.popitem(last=False)
                evicted.graph.reset()
                if not self._graphs:  # a pool no graph holds any more cannot take another capture (torch asserts)
                    self._pool = torch.cuda.graph_pool_handle()
            try:
                entry = self._graphs[key] = self._capture(batch)
            except Exception as exc:  # an op that cannot be captured: this engine steps eagerly from now on
                logger.warning("capturing the training step failed (%s); the pack steps eagerly", exc)
                self.enabled = False
                self._graphs.clear()
                self._grads.zero_()  # the warm-up runs added gradients
                return None
        else:
            self._graphs.move_to_end(key)
            for static, new in zip(_tensors(entry.batch), _tensors(batch), strict=True):
                static.copy_(new, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.losses.clone()

    @property
    def count(self) -> int:
        """Graphs captured and kept (one per batch shape)."""
        return len(self._graphs)

    def close(self) -> None:
        """Drop the graphs and their memory pool."""
        self._graphs.clear()
        self.enabled = False

    def _capture(self, batch: PackedBatch) -> _Graph:
        started = time.perf_counter()
        try:
            return self._capture_graph(batch)
        finally:
            torch.cuda.synchronize()  # the warm-up runs and the capture are queued: count them done
            self.capture_s += time.perf_counter() - started

    def _capture_graph(self, batch: PackedBatch) -> _Graph:
        def body() -> torch.Tensor:
            self._grads.zero_()
            return self._forward_backward(batch)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS if self.captures else FIRST_WARMUP_RUNS):
                body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.empty_cache()  # the warm-up's activations: the graph's own come from its pool
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer's writer thread may copy a snapshot to the host meanwhile (its own stream).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            losses = body()
        self.captures += 1
        logger.info("captured a training step of shape %s (%d graphs)", batch.shape_key(), len(self._graphs) + 1)
        return _Graph(graph, batch, losses)


def _tensors(value: object) -> list[torch.Tensor]:
    """Every tensor in a batch, in field order (dataclasses and tuples walked; host values skipped)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    if isinstance(value, tuple):
        return [t for item in value for t in _tensors(item)]
    return []
