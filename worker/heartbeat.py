"""The worker's heartbeat: a small process of its own, which training cannot starve.

A beat sent from a thread of the training process waited for that process's GIL and CPU: on a busy machine the
only worker was declared lost while it trained (issue 32). So the beats come from a child process (`Heartbeat.start`:
spawned, it imports no torch), which reads what they say from memory it shares with the worker process
(`BeatState`): the packs this process runs, the base models it holds warm, the memory its packs left free, and a
progress count each pack bumps on every step and phase. The child ends with its worker: it watches its parent and
stops beating once the parent is gone (killed included), so the scheduler notices a dead worker as before.

Liveness is also judged by progress: each beat says of each pack it names when the pack last progressed
(`ProgressClock`, by the child's clock), and the scheduler ends a pack that has not for `LORAPLANE_WORKER_STALL_S`
(a hung training process beats on; scheduler/service/ingest.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.bus import SCHEDULER_STREAM, Bus, get_bus
from common.messages import WorkerHeartbeat
from worker.availability import ModelAvailability

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.25  # how soon the heartbeat process notices that its worker is gone
LOCK_WAIT_S = 5.0  # a heartbeat process killed while it held the state's lock must not hang the worker


@dataclass(frozen=True)
class Incarnation:
    """This worker process: a new id on every start, so the scheduler tells a restarted worker (same worker
    id) from the process it replaced, and can end that process's packs at once instead of waiting for a
    heartbeat timeout that never comes (the new process beats under the same id). The rank processes of a
    worker over several GPUs (worker/rank_pool.py) report under their worker process's."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)


class BeatState:
    """What the worker process tells its heartbeat process, in shared memory: the packs it runs (up to `MAX_PACKS`,
    one slot each with its progress count), the warm base models (as JSON) and the memory its packs left free. The
    packs and the models are written under a lock (rarely: a pack's start and end, a model loaded or evicted); each
    progress count without one, on every step (one writer per pack; a lost increment between two threads is
    harmless, only a change is read)."""

    PACK_BYTES = 64  # a pack id is at most 40 characters (packs.id)
    MAX_PACKS = 8  # the most a worker runs at once (LORAPLANE_WORKER_MAX_PACKS's bound)
    WARM_BYTES = 64 * 1024  # the warm models' JSON: ~150 bytes a model

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._lock = ctx.Lock()
        self._packs = [ctx.RawArray(ctypes.c_char, self.PACK_BYTES) for _ in range(self.MAX_PACKS)]
        self._progress = ctx.RawArray(ctypes.c_int64, self.MAX_PACKS)
        self._warm = ctx.RawArray(ctypes.c_char, self.WARM_BYTES)
        self._free = ctx.RawValue(ctypes.c_int64, -1)  # -1: not said
        self._sampler = ctx.RawValue(ctypes.c_int64, -1)  # the sampler process's device memory; -1: not said
        self._draining = ctx.RawValue(ctypes.c_bool, False)  # the worker drains on SIGTERM (worker/drain.py)

    def _locked(self) -> bool:
        got = self._lock.acquire(timeout=LOCK_WAIT_S)
        if not got:  # its holder died holding it: write anyway (no one reads half of it)
            log.warning("the heartbeat's shared state stayed locked for %.0fs; writing without the lock", LOCK_WAIT_S)
        return got

    def add_pack(self, pack_id: str) -> int:
        """Names ``pack_id`` from now on, its progress count from 0; its slot (for `progressed`)."""
        raw = pack_id.encode()
        if not raw or len(raw) >= self.PACK_BYTES:
            raise ValueError(f"pack id {pack_id!r} is empty or longer than {self.PACK_BYTES - 1} bytes")
        got = self._locked()
        try:
            free = [i for i, held in enumerate(self._packs) if not held.value]
            if not free:
                raise RuntimeError(f"this worker already runs {self.MAX_PACKS} packs")
            self._packs[free[0]].value = raw
            self._progress[free[0]] = 0
            return free[0]
        finally:
            if got:
                self._lock.release()

    def remove_pack(self, slot: int) -> None:
        """The pack of ``slot`` is no longer named."""
        got = self._locked()
        try:
            self._packs[slot].value = b""
        finally:
            if got:
                self._lock.release()

    def set_warm(self, warm: list[dict[str, Any]]) -> None:
        """The warm base models (worker/model_cache.py), most recently used first; those past the room are left
        out (the least recently used)."""
        while True:
            raw = json.dumps(warm, separators=(",", ":")).encode()
            if len(raw) < self.WARM_BYTES or not warm:
                break
            warm = warm[:-1]
        got = self._locked()
        try:
            self._warm.value = raw
        finally:
            if got:
                self._lock.release()

    def set_free_memory(self, free_bytes: int | None) -> None:
        self._free.value = -1 if free_bytes is None else max(0, free_bytes)

    def set_sampler_bytes(self, held: int | None) -> None:
        self._sampler.value = -1 if held is None else max(0, held)

    def sampler_bytes(self) -> int | None:
        """The device memory the worker's sampler process holds (worker/sampler.py), or None when never told."""
        held = int(self._sampler.value)
        return None if held < 0 else held

    def set_draining(self) -> None:
        self._draining.value = True

    def draining(self) -> bool:
        return bool(self._draining.value)

    def clear_packs(self) -> None:
        """Names no pack any more (the worker gives up its packs: `Heartbeat.abandon`)."""
        got = self._locked()
        try:
            for held in self._packs:
                held.value = b""
        finally:
            if got:
                self._lock.release()

    def progressed(self, slot: int) -> None:
        self._progress[slot] += 1

    def read(self) -> tuple[list[tuple[str, int]], list[dict[str, Any]] | None, int | None]:
        """(each named pack with its progress count, in slot order; warm models or None when never told; free
        memory or None when never told), as one consistent reading."""
        got = self._locked()
        try:
            packs = [(held.value.decode(), int(self._progress[i])) for i, held in enumerate(self._packs) if held.value]
            warm, free = self._warm.value, int(self._free.value)
        finally:
            if got:
                self._lock.release()
        return packs, json.loads(warm) if warm else None, None if free < 0 else free


class BeatProgress:
    """A pack process's side of the heartbeat (worker/pack_processes.py): it bumps the progress count of the slot
    the worker process gave its pack in the shared state, and names nothing itself (the worker process does)."""

    def __init__(self, state: BeatState) -> None:
        self.state = state
        self._slots: dict[str, int] = {}

    def bind(self, pack_id: str, slot: int | None) -> None:
        if slot is not None:
            self._slots[pack_id] = slot

    def unbind(self, pack_id: str) -> None:
        self._slots.pop(pack_id, None)

    def progressed(self, pack_id: str) -> None:
        slot = self._slots.get(pack_id)
        if slot is not None:
            self.state.progressed(slot)


@dataclass
class ProgressClock:
    """When each pack the beats name last progressed, as the beats see it: the time a beat first saw the pack's
    current progress count. Measured where the beats are sent, so the scheduler compares it with the beat's own
    `sent_at` (one clock)."""

    seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # pack id -> (progress count, first seen)

    def observe(self, packs: list[tuple[str, int]], now: float) -> dict[str, float]:
        """Each named pack's last progress; packs no longer named are forgotten (one named again starts afresh)."""
        seen: dict[str, tuple[int, float]] = {}
        for pack_id, progress in packs:
            before = self.seen.get(pack_id)
            seen[pack_id] = before if before is not None and before[0] == progress else (progress, now)
        self.seen = seen
        return {pack_id: at for pack_id, (_, at) in seen.items()}


def publish_beat(bus: Bus, identity: dict[str, Any], incarnation: Incarnation, state: BeatState, clock: ProgressClock,
                 models: Callable[[], list[str] | None] | None) -> None:
    """One beat: the worker's identity, what `state` says now, and the registered models this machine can load
    (`models`, e.g. `worker.availability.ModelAvailability.models`, when given and known: a beat without them is
    taken as "every model")."""
    extra: dict[str, Any] = {}
    if models is not None:
        try:
            names = models()
        except Exception:  # noqa: BLE001 - a failed check must not silence the beat (it would look dead)
            log.exception("could not tell which models this worker can load")
            names = None
        if names is not None:
            extra["models"] = names
    # The time is taken before the state is read: a beat that names no pack was sent before the worker set one, so
    # before its `pack.started` (the scheduler ends a running pack that a beat sent after its start does not name).
    sent_at = time.time()
    packs, warm, free = state.read()
    sampler = state.sampler_bytes()
    if sampler is not None:
        extra["sampler_bytes"] = sampler
    if state.draining():
        extra["draining"] = True
    progressed_at = clock.observe(packs, sent_at)
    named = [{"pack_id": p, "progress": n, "progressed_at": progressed_at[p]} for p, n in packs]
    if packs:  # the first, as a scheduler from before `packs` reads it
        extra.update(progress=packs[0][1], progressed_at=progressed_at[packs[0][0]])
    beat = WorkerHeartbeat(**identity, pack_id=packs[0][0] if packs else None, packs=named,
                           incarnation=incarnation.id, started_at=incarnation.started_at, sent_at=sent_at,
                           warm_models=warm, free_memory_bytes=free, **extra)
    bus.publish(SCHEDULER_STREAM, beat.to_dict())


@dataclass(frozen=True)
class BeaterConfig:
    """What the heartbeat process needs (sent to a spawned process: plain values only)."""

    identity: dict[str, Any]
    incarnation: Incarnation
    interval_s: float
    parent_pid: int
    names_models: bool  # whether the beats name the registered models this machine can load


def beat_forever(config: BeaterConfig, state: BeatState, stop: Any) -> None:
    """The heartbeat process: a beat every `interval_s` until told to stop or its worker process is gone. It
    ignores the signals a terminal or a process manager sends the worker's process group: while the worker shuts
    down (finishing its pack) it still lives, and beats."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s heartbeat %(levelname)s %(name)s %(message)s")
    bus = get_bus()  # its own connection, to the bus the settings name (the worker's)
    models = ModelAvailability(bus).models if config.names_models else None
    clock = ProgressClock()
    next_beat = 0.0
    while not stop.is_set() and os.getppid() == config.parent_pid:
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + config.interval_s
            try:
                publish_beat(bus, config.identity, config.incarnation, state, clock, models)
            except Exception as exc:  # noqa: BLE001 - the bus may blink; the next beat retries (none is queued:
                log.warning("heartbeat failed: %s", exc)  # an old beat says nothing about now)
        stop.wait(min(PARENT_POLL_S, max(0.0, next_beat - time.monotonic())))


class Heartbeat:
    """The worker's presence on the bus, every `interval_s`, from a process of its own (`start`); the scheduler
    declares the worker lost when the beats stop.

    Each beat names the packs this process is running (none, one, or up to its `max_packs`; `add_pack`,
    `remove_pack`). The scheduler ends any running pack of this worker that a beat does not name: the worker names a
    pack before its `pack.started` and clears it after its last report went out, and a beat is timed before it reads
    the packs (`publish_beat`).

    Each beat also names the registered models this machine can load (when `models` is given: the heartbeat process
    reads the registry itself), the base models it holds loaded (`warm_models`, `worker.model_cache.ModelCache.warm`)
    and the memory its packs left free (`free_memory`) and its sampler holds (`sampler_bytes`), each copied into the
    shared state every `interval_s` by a thread of the worker (a starved one only delays a change), and, with each
    pack, its progress count and when it last changed (`progressed`).

    `beat()` sends one beat from the calling process (tests, benchmarks).
    """

    def __init__(self, bus: Bus, interval_s: float, identity: dict[str, Any], incarnation: Incarnation,
                 models: Callable[[], list[str] | None] | None = None) -> None:
        self.bus = bus
        self.interval_s = interval_s
        self.identity = identity
        self.incarnation = incarnation
        self._models = models
        self.warm_models: Callable[[], list[dict[str, Any]]] | None = None  # set once the worker's runner exists
        self.free_memory: Callable[[], int | None] | None = None  # likewise
        self.sampler_bytes: Callable[[], int | None] | None = None  # set once its sampler exists
        self._slots: dict[str, int] = {}  # pack id -> its slot in the shared state
        self.state = BeatState()
        self._clock = ProgressClock()  # for `beat()`; the heartbeat process keeps its own
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = self._ctx.Event()
        self.process: multiprocessing.process.BaseProcess | None = None

    def add_pack(self, pack_id: str) -> None:
        self._slots[pack_id] = self.state.add_pack(pack_id)

    def remove_pack(self, pack_id: str) -> None:
        slot = self._slots.pop(pack_id, None)
        if slot is not None:
            self.state.remove_pack(slot)

    def slot_of(self, pack_id: str) -> int | None:
        """``pack_id``'s slot in the shared state (a pack process bumps its progress there: `BeatProgress`)."""
        return self._slots.get(pack_id)

    def progressed(self, pack_id: str) -> None:
        """The pack made progress (a step, a validation, a phase of its set-up or end): cheap, call it freely."""
        slot = self._slots.get(pack_id)
        if slot is not None:
            self.state.progressed(slot)

    def _copy_warm(self) -> None:
        try:
            if self.warm_models is not None:
                self.state.set_warm(self.warm_models())
            if self.free_memory is not None:
                self.state.set_free_memory(self.free_memory())
            if self.sampler_bytes is not None:
                self.state.set_sampler_bytes(self.sampler_bytes())
        except Exception:  # noqa: BLE001 - the beats go out without them
            log.exception("could not tell which models this worker holds warm, its free memory or its sampler's")

    def beat(self) -> None:
        self._copy_warm()
        publish_beat(self.bus, self.identity, self.incarnation, self.state, self._clock, self._models)

    def drain(self) -> None:
        """From now on every beat says the worker drains (worker/drain.py); one goes out now, from the calling thread,
        ahead of its trials' pauses (without `beat`'s copy of the warm models, which may wait for a model's load)."""
        self.state.set_draining()
        publish_beat(self.bus, self.identity, self.incarnation, self.state, self._clock, self._models)

    def abandon(self, timeout_s: float = 2.0) -> None:
        """The worker gives up its packs as it exits at its drain's bound: the heartbeat process stops, so that no
        beat of it names them again, and one last beat names none (the scheduler ends them at once, as for a lost
        worker, instead of after its worker timeout)."""
        self.stop(timeout_s)
        self.state.clear_packs()
        publish_beat(self.bus, self.identity, self.incarnation, self.state, self._clock, self._models)

    def start(self) -> None:
        """Starts the heartbeat process, and the thread that keeps its warm models current and starts it again
        should it die while the worker lives."""
        self._copy_warm()
        self._spawn()
        threading.Thread(target=self._keep, name="heartbeat-keeper", daemon=True).start()

    def _spawn(self) -> None:
        config = BeaterConfig(identity=self.identity, incarnation=self.incarnation, interval_s=self.interval_s,
                              parent_pid=os.getpid(), names_models=self._models is not None)
        self.process = self._ctx.Process(target=beat_forever, args=(config, self.state, self._stop),
                                         name="loraplane-heartbeat", daemon=True)
        self.process.start()

    def _keep(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._copy_warm()
            if self.process is not None and not self.process.is_alive() and not self._stop.is_set():
                log.warning("the heartbeat process ended (exit code %s); starting another", self.process.exitcode)
                self._spawn()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self.process is not None:
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
