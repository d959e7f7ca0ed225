"""A worker over several GPUs of one host (`loraplane worker --gpus 0,1`): one rank per GPU (docs/multi-gpu.md).

Rank 0 is the worker process itself: it consumes the worker's queue, beats, and runs its own share of each pack.
Ranks 1..n-1 are its child processes, started with it and kept for its life, so that a base model, once loaded and
sharded, stays loaded between packs in each of them. A pack runs on all of them at once (worker/engine/distributed.py:
the frozen base sharded, each trial on one rank, the ranks in lockstep). What they share of a pack, and how:

- the pack message: rank 0 hands it to the others (a queue each) after `pack.started`;
- the trials: dealt in turn (`assign_ranks`). Each rank trains its own and reports their points, checkpoints and
  ends on the bus itself, under the worker's id and incarnation; each reads the worker's command stream itself for
  its trials' stops (every rank reads the whole stream);
- back-fills: taken from the stream by rank 0 alone and dealt to the ranks with free slots, an agreement before
  each pack step (`Ranks.share_admissions`);
- readiness: once each rank has loaded the model and read its trials' files and checkpoints, the ranks agree that
  all are ready (`Ranks.ready`) before the first pass. A rank that is not fails the pack on every rank, which rank 0
  reports (`pack.failed`), and no rank is left waiting;
- the pack's end: rank 0 waits until every rank's reports went out before `pack.finished`, and reports the pack's
  profile: its steps over all ranks (`Lockstep.pack_stats`), one unit to the scheduler's cost model.

A failure once the ranks train, of any rank, leaves the others waiting in a collective (docs/multi-gpu.md, "The
lockstep"). So that rank's process ends at once (exit status 1), and the worker process ends when any of its ranks
does (`RankPool`'s watcher), and each rank when the worker does. Its heartbeat stops; started again (compose's
restart policy, systemd), its new incarnation ends the pack at once, and the scheduler requeues the pack's trials
from their checkpoints.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.messages import PackMessage
from worker.drain import DrainFlag
from worker.engine.distributed import Lockstep, assign_ranks
from worker.heartbeat import Incarnation

log = logging.getLogger(__name__)

T = TypeVar("T")
BACKEND = {"cuda": "nccl", "cpu": "gloo"}  # by device type: NCCL between GPUs, gloo for ranks on the CPU (tests)


@dataclass(frozen=True)
class RankConfig:
    """What a rank process needs to join its worker (sent to a spawned process: plain values only)."""

    worker_id: str
    devices: tuple[str, ...]  # rank r's device
    init_method: str  # the process group's rendezvous (`tcp://127.0.0.1:<port>`)
    incarnation: Incarnation  # the worker process's: every rank reports under it
    timeout_s: float  # a collective that waits longer fails (LORAPLANE_WORKER_RANK_TIMEOUT_S)
    cpu_threads: int  # LORAPLANE_WORKER_CPU_THREADS (0: torch's default)
    preload: str = ""  # LORAPLANE_WORKER_PRELOAD: every rank loads (and shards) these models at its start
    loglevel: str = "INFO"
    drain: DrainFlag | None = None  # set once the worker drains on SIGTERM: each rank pauses its own trials

    @property
    def world(self) -> int:
        return len(self.devices)


@dataclass
class Ranks:
    """This process's place among its worker's ranks, and the agreements of one pack among them (every rank makes
    the same calls in the same order)."""

    rank: int
    world: int
    lockstep: Lockstep
    training: bool = False  # past `ready`: a failure now leaves the other ranks waiting (the module docstring)

    def mine(self, trials: Sequence[T]) -> list[T]:
        """This rank's share of the pack's starting trials."""
        return assign_ranks(trials, self.world)[self.rank]

    def capacity(self, capacity: int | None) -> int | None:
        """This rank's share of the pack's slots (the pack message's capacity is the whole pack's)."""
        return None if capacity is None else -(-capacity // self.world)

    def ready(self, error: BaseException | None) -> None:
        """Agree that every rank can start the pack (``error``: why this one cannot); raise on every rank if one
        cannot, this rank's own error where it has one."""
        if self.lockstep.any(error is not None):
            if error is not None:
                raise error
            raise RuntimeError("the pack could not be set up on another GPU of this worker (its log says why)")
        self.training = True

    def share_admissions(self, free: int, take: Callable[[int], list[T]]) -> list[T]:
        """This rank's share of the back-fills waiting to join the pack. Every rank says how many slots it has
        free; rank 0 takes up to as many back-fills from ``take`` (its command inbox) and deals them out
        (`deal_admissions`)."""
        group = self.lockstep.group
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(gathered, torch.tensor([free], dtype=torch.int64), group=group)
        frees = [int(g.item()) for g in gathered]
        if not sum(frees):  # every rank knows: nothing to deal, no second agreement
            return []
        box: list[list[list[T]] | None] = [deal_admissions(take(sum(frees)), frees) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        assert box[0] is not None
        return box[0][self.rank]


def deal_admissions(items: Sequence[T], frees: Sequence[int]) -> list[list[T]]:
    """``items`` dealt to the ranks with free slots (``frees``, by rank), each to the rank with the most left
    (ties: the lower rank), so the ranks' rows per step stay even; items beyond the free slots are dropped (the
    caller took no more than there are)."""
    left, shares = list(frees), [[] for _ in frees]  # type: list[int], list[list[T]]
    for item in items:
        rank = max(range(len(left)), key=lambda r: (left[r], -r))
        if left[rank] <= 0:
            break
        shares[rank].append(item)
        left[rank] -= 1
    return shares


def join(rank: int, config: RankConfig) -> Ranks:
    """Join the worker's process group as ``rank``, on its device."""
    device = torch.device(config.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(BACKEND[device.type], init_method=config.init_method, rank=rank,
                            world_size=config.world, timeout=timedelta(seconds=config.timeout_s))
    return Ranks(rank, config.world, Lockstep())  # every rank creates the lockstep's group, in the same order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankPool:
    """Rank 0's side of the worker's ranks: starts ranks 1..n-1 and joins the process group with them, hands them
    each pack and waits for them to end it, and ends the worker process if one of them dies."""

    def __init__(self, config: RankConfig, entry: Callable[[int, RankConfig, Any, Any], None]) -> None:
        """``entry``: each rank process's main (worker/main.py ``rank_main``: passed in, so that this protocol,
        which the runner uses, does not import the runner)."""
        self.config = config
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self._packs = [ctx.Queue() for _ in range(config.world - 1)]
        self._ended = ctx.Queue()  # (rank, pack id) as each rank ends its share of a pack
        # Not daemonic: a rank may start processes of its own (torch.compile's workers); each ends with the worker
        # instead (worker/main.py `_exit_with_parent`).
        self._processes = [ctx.Process(target=entry, args=(rank, config, self._packs[rank - 1], self._ended),
                                       name=f"rank{rank}") for rank in range(1, config.world)]
        self._closing = False

    def start(self) -> Ranks:
        for process in self._processes:
            process.start()
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()
        return join(0, self.config)

    def hand_over(self, pack: PackMessage) -> None:
        for queue in self._packs:
            queue.put(pack)

    def wait(self, pack_id: str) -> None:
        """Until every other rank has ended its share of ``pack_id`` (its reports went out)."""
        waiting = set(range(1, self.config.world))
        while waiting:
            rank, ended = self._ended.get()
            if ended == pack_id:
                waiting.discard(rank)

    def close(self) -> None:
        self._closing = True
        for queue in self._packs:
            queue.put(None)
        for process in self._processes:
            process.join(timeout=30)

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self._processes])
        if not self._closing:
            for process in self._processes:
                process.join(timeout=0.5)  # its sentinel closes as it exits, a moment before it can be reaped
            dead = [f"{p.name} (exit status {p.exitcode})" for p in self._processes if p.exitcode is not None]
            log.critical("worker %s: %s ended; the worker ends with it (see worker/rank_pool.py)",
                         self.config.worker_id, ", ".join(dead))
            os._exit(1)
