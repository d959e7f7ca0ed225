"""Several packs on one worker (issue 34): which pack may start beside the ones running, what they reserved, and
which idle warm models must go to make room.

A worker on one device runs up to `LORAPLANE_WORKER_MAX_PACKS` packs at once, each in a pack process of its own
(worker/pack_processes.py says why processes and not threads), so that a short task of one base model need not wait
behind a long pack of another. The scheduler places a pack beside others only where its planned memory fits what
they left (scheduler/service/planner_io.py); the worker checks again when the pack arrives (`refusal`) and refuses
one that does not fit, which the scheduler takes back without spending an attempt of its trials (`pack.refused`).

Each pack reserves the bytes its plan predicted (`PackMessage.memory_bytes`: its base model, its members'
activations, adapters and optimizer state, from the cost model fitted on pack profiles). The device's measured free
memory is not the test: each process's caching allocator holds freed blocks, so it says little about what a pack
can still get. What an idle pack process keeps warm is counted beside the reservations, and goes when a pack needs
its room (`idle_models_to_drop`).

Two packs of one base model never run together: a second pack of a running model joins the first as back-fills
(the scheduler sends it so), rather than holding a second copy of its weights.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

GB = 1e9


DEFAULT_GPU_PACKS = 2  # LORAPLANE_WORKER_MAX_PACKS=0 on one GPU (measured: benchmarks/results/issue34/SUMMARY.md)


def max_packs_for(configured: int, *, device_type: str, gpus: int) -> int:
    """How many packs a worker runs at once: ``configured`` (LORAPLANE_WORKER_MAX_PACKS; 0: `DEFAULT_GPU_PACKS` on
    one GPU, 1 on the CPU, where packs would only share its cores). A worker over several GPUs runs one (each pack
    spans all of them)."""
    if gpus > 1:
        return 1
    if configured:
        return configured
    return DEFAULT_GPU_PACKS if device_type == "cuda" else 1


@dataclass(frozen=True)
class Reservation:
    pack_id: str
    base_model: str
    bytes: int


def refusal(incoming: Reservation, running: list[Reservation], *, max_packs: int, memory_bytes: int) -> str | None:
    """Why ``incoming`` may not start beside ``running`` (None: it may). A pack that would run alone always may:
    the planner's prediction is its best guess, and the pack's own failure says more than a refusal."""
    if not running:
        return None
    if len(running) >= max_packs:
        return f"the worker already runs {len(running)} packs, its most (LORAPLANE_WORKER_MAX_PACKS)"
    if any(r.base_model == incoming.base_model for r in running):
        return f"a pack of {incoming.base_model} already runs on this worker (its trials join it as back-fills)"
    reserved = sum(r.bytes for r in running)
    if incoming.bytes + reserved > memory_bytes:
        return (f"its planned {incoming.bytes / GB:.2f} GB do not fit beside the {reserved / GB:.2f} GB reserved by "
                f"{len(running)} running pack(s) in the worker's {memory_bytes / GB:.2f} GB")
    return None


@dataclass(frozen=True)
class IdleModel:
    """A base model an idle pack process keeps warm."""

    process: int
    name: str
    bytes: int
    last_used_at: float


def idle_models_to_drop(reserved_bytes: int, idle: list[IdleModel], *, memory_bytes: int) -> list[IdleModel]:
    """The idle warm models to drop, least recently used first, so that the running packs' reservations
    (``reserved_bytes``, the starting pack's included) and the idle models left fit in ``memory_bytes``."""
    total = reserved_bytes + sum(m.bytes for m in idle)
    out: list[IdleModel] = []
    for model in sorted(idle, key=lambda m: (m.last_used_at, m.process, m.name)):
        if total <= memory_bytes:
            break
        out.append(model)
        total -= model.bytes
    return out


@dataclass
class RunningPacks:
    """The packs this worker runs and what each reserved (thread-safe: each pack's Celery thread reserves and
    releases its own)."""

    max_packs: int
    memory_bytes: int
    _running: dict[str, Reservation] = field(default_factory=dict)
    _shared: set[str] = field(default_factory=set)  # packs that ran beside another at some point
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reserve(self, incoming: Reservation) -> str | None:
        """Reserves ``incoming`` and returns None, or returns why it may not start (nothing reserved)."""
        with self._lock:
            reason = refusal(incoming, list(self._running.values()), max_packs=self.max_packs,
                             memory_bytes=self.memory_bytes)
            if reason is None:
                self._running[incoming.pack_id] = incoming
                if len(self._running) > 1:
                    self._shared.update(self._running)
            return reason

    def release(self, pack_id: str) -> bool:
        """Frees ``pack_id``'s reservation; whether it shared the device with another pack while it ran."""
        with self._lock:
            self._running.pop(pack_id, None)
            shared = pack_id in self._shared
            self._shared.discard(pack_id)
            return shared

    def shared(self, pack_id: str) -> bool:
        with self._lock:
            return pack_id in self._shared

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(r.bytes for r in self._running.values())

    def count(self) -> int:
        with self._lock:
            return len(self._running)

    def free_bytes(self) -> int:
        """The worker's memory less every running pack's reservation (what the heartbeat reports)."""
        with self._lock:
            return max(0, self.memory_bytes - sum(r.bytes for r in self._running.values()))
