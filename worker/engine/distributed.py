"""A pack over several GPUs of one host: the frozen base sharded, each trial on one rank (docs/multi-gpu.md).

Adapter parallelism (ALTO §6.3): every decoder layer of the frozen base is sharded over the ranks with FSDP2
(`shard_base`), so a base too large for one GPU's memory fits in all of them; each trial lives on one rank only,
with its adapter, gradients and optimizer state there and nowhere else (nothing of it is replicated or reduced).
Each rank runs its own `PackEngine` over its own trials' rows: one forward and one backward a step, in which each
layer's weights are gathered from the ranks for the pass and freed after it. A trial's math is the one-GPU
pack's, row for row: its adapter comes out the same (`tests/engine/test_distributed.py`).

The price is lockstep. Every pass through the sharded layers is a collective (each layer's all-gather), so every
rank must run the same passes in the same order, whatever its own trials need; a rank that is still in a layer's
all-gather while another has gone on to something else waits for ever. So before each phase of a pack step the
ranks agree how many passes it takes (`Lockstep.most`: the largest of any rank's own count), each runs its own,
and a rank with fewer makes up the difference with idle passes of one pad token through the base
(`ModelPasses.idle_pass`, worker/engine/passes.py). The phases, in worker/engine/trainer.py's loop: whether any
rank has a live trial (the loop goes on while one does), the scoring of trials that leave before the step, the step
(a forward and a backward), validation, and the scoring after it; greedy generation agrees once per new token
(worker/engine/generation.py). A pass that fails on one rank part way through its layers cannot be made up: the other
ranks wait in that layer's collective, and the pack fails as a whole (its process group times out).

Not covered here: which trial goes to which rank is the caller's (`assign_ranks`); the worker that spawns the ranks
and hands them packs and back-fills is worker/rank_pool.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from worker.engine.slots import StepStats

Pass = Literal["forward", "train"]  # a forward alone (validation, generation), or a forward and its backward
T = TypeVar("T")


class IdlePasses(Protocol):
    """What the lockstep drives on a rank with fewer passes than the others (``ModelPasses`` is one: typed by what it
    does, so that this module imports nothing of the engine that uses it)."""

    def idle_pass(self, *, train: bool) -> None: ...


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (`model.model.layers` in the Llama family and its relatives): what
    ``shard_base`` shards and activation checkpointing (recompute.py) recomputes.

    Raises:
        ValueError: a model whose base has no ``layers`` ModuleList.
    """
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers (expected base_model.layers)")
    return layers


def shard_base(model: nn.Module, *, device: torch.device | None = None,
               group: dist.ProcessGroup | None = None, reshard_after_forward: bool = True) -> None:
    """Shard every decoder layer's frozen weights over the ranks of ``group`` (FSDP2, one unit per layer), on
    ``device`` (default: where the model is).

    Each layer is gathered for its forward and freed after it, and gathered again for the backward: a rank holds
    its share of every layer plus one whole layer at a time. With ``reshard_after_forward=False`` a layer gathered
    for the forward stays whole until its backward: half the gathers of a training pass, for a whole base's
    memory at the turn of the pass (benchmarks/multi_gpu.py's ``--layout shard-keep`` measures the trade).

    The embeddings, the final norm and the output projection stay whole on every rank (they run outside the
    layers' forward, and a tied output projection is the embedding's own weight); for a large model they are a few
    GB of its tens. A model too large for one GPU is loaded in host memory and sharded from there: FSDP moves each
    layer to ``device`` as it shards it, so the GPU never holds more than its shards and one whole layer; the rest
    follows. Call it before the pack's engine wraps the layers: the wrappers then use the gathered weights. A model
    made on the meta device (no weights yet) gets empty storage on ``device``, each rank's shards only, for its
    caller to fill (benchmarks/base_models.py's ``build`` draws a large shape's random weights in place that way).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = group or dist.group.WORLD
    assert group is not None, "torch.distributed is not initialised"
    device = device or next(model.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    else:
        model.to(device)  # what is not sharded: the embeddings, the final norm, the output projection


def assign_ranks(items: Sequence[T], world: int) -> list[list[T]]:
    """``items`` dealt to ``world`` ranks in turn (item i to rank i mod world): in a pack of similar trials each
    rank gets as many rows per step as any other, which is what keeps the lockstep from waiting."""
    return [list(items[rank::world]) for rank in range(world)]


class Lockstep:
    """Keeps the ranks of one pack running the same passes through the sharded base (see the module docstring).
    Every rank must make the same calls in the same order."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        group = group or dist.group.WORLD
        assert group is not None, "torch.distributed is not initialised"
        # The ranks agree over a host (gloo) group of their own: a count reduced on the GPUs (NCCL) would make each
        # agreement, several a step, wait for the device's queue, where the engine's step waits once. Every rank
        # of the world constructs it (creating a group is collective).
        if dist.get_backend(group) == "gloo":
            self.group = group
        else:
            self.group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        self.idle: dict[Pass, int] = {"forward": 0, "train": 0}  # idle passes run so far (tests, benchmarks)

    def most(self, own: int) -> int:
        """The largest ``own`` of any rank."""
        tensor = torch.tensor([own], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return self.most(int(flag)) > 0

    def pack_stats(self, own: StepStats | None) -> StepStats:
        """The pack's step over every rank, from each rank's ``own`` (None: it had no trial to step): slots and
        tokens summed, and peak memory summed too (the pack's peak over its GPUs, as the scheduler's cost model
        counts a pack on several GPUs: one unit), the step's time the longest rank's. Where the host's time
        went (data, prefetch, device wait) and the step's index stay this rank's own."""
        fields = [0.0] * 6 if own is None else [
            own.active_slots, own.tokens, own.padded_tokens, own.target_tokens, own.peak_memory_bytes or 0, own.seconds]
        gathered = [torch.zeros(6, dtype=torch.float64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, torch.tensor(fields, dtype=torch.float64), group=self.group)
        total = torch.stack(gathered).sum(dim=0).tolist()
        peak = int(total[4]) or None  # None: no rank measures its memory (the CPU)
        base = own or StepStats(0, 0, 0, 0, 0, 0.0, None)
        return replace(base, active_slots=int(total[0]), tokens=int(total[1]), padded_tokens=int(total[2]),
                       target_tokens=int(total[3]), peak_memory_bytes=peak,
                       seconds=max(float(g[5]) for g in gathered))

    def pad(self, passes: IdlePasses, kind: Pass, count: int) -> None:
        """``count`` idle passes of ``kind``: this rank's share of a phase the others have more passes in."""
        for _ in range(count):
            passes.idle_pass(train=kind == "train")
        self.idle[kind] += count
