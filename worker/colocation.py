"""Several packs on one worker (issue 34): which pack may start beside the ones running, and what they reserved.

A worker on one device runs up to `LORAPLANE_WORKER_MAX_PACKS` packs at once, each on a thread of its own (Celery's
thread pool) and, on CUDA, its own stream, so that a short task of one base model need not wait behind a long pack of
another. The scheduler places a pack beside others only where its planned memory fits what they left
(scheduler/service/planner_io.py); the worker checks again when the pack arrives (`refusal`) and refuses one that
does not fit, which the scheduler takes back without spending an attempt of its trials (`pack.refused`).

Each pack reserves the bytes its plan predicted (`PackMessage.memory_bytes`: its base model, its members'
activations, adapters and optimizer state, from the cost model fitted on pack profiles). The device's measured free
memory is not the test: the caching allocator holds freed blocks, and warm models that no pack uses are evicted
on demand (worker/model_cache.py), so it says little about what a pack can still get.

Two packs of one base model never run together: a pack's engine wraps its model's layers in place
(worker/engine/lora.py), so a second pack of that model joins the first as a back-fill instead (the scheduler sends
it so).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

GB = 1e9
# The interpreter's thread switch interval on a worker running several packs (Python's default: 5 ms). Each pack's
# thread gives up the GIL at every blocking CUDA call and waits for it back; behind another pack's busy thread it
# waited up to a whole interval each time (the convoy effect): on the H200 with the default, SmolLM2's pack beside a
# 0.4B one stepped at 0.74 s instead of 0.035 s.
GIL_SWITCH_S = 0.0002


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
        return f"a pack of {incoming.base_model} already runs on this worker (its engine holds the model's layers)"
    reserved = sum(r.bytes for r in running)
    if incoming.bytes + reserved > memory_bytes:
        return (f"its planned {incoming.bytes / GB:.2f} GB do not fit beside the {reserved / GB:.2f} GB reserved by "
                f"{len(running)} running pack(s) in the worker's {memory_bytes / GB:.2f} GB")
    return None


@dataclass
class RunningPacks:
    """The packs this worker runs and what each reserved (thread-safe: each pack runs on its own thread)."""

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

    def count(self) -> int:
        with self._lock:
            return len(self._running)

    def free_bytes(self) -> int:
        """The worker's memory less every running pack's reservation (what the heartbeat reports)."""
        with self._lock:
            return max(0, self.memory_bytes - sum(r.bytes for r in self._running.values()))
