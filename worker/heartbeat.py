"""The worker's heartbeat: a small process of its own, which training cannot starve.

A beat sent from a thread of the training process waited for that process's GIL and CPU: on a busy machine the
only worker was declared lost while it trained (issue 32). So the beats come from a child process (`Heartbeat.start`:
spawned, it imports no torch), which reads what they say from memory it shares with the worker process
(`BeatState`): the pack this process runs, the base models it holds warm, and a progress count the pack bumps on
every step and phase. The child ends with its worker: it watches its parent and stops beating once the parent is gone
(killed included), so the scheduler notices a dead worker as before.

Liveness is also judged by progress: each beat that names a pack says when the pack last progressed (`ProgressClock`,
by the child's clock), and the scheduler ends a pack that has not for `LORAPLANE_WORKER_STALL_S` (a hung training
process beats on; scheduler/service/ingest.py).
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
    """What the worker process tells its heartbeat process, in shared memory: the pack it runs, the warm base models
    (as JSON) and the pack's progress count. The pack and the models are written under a lock (rarely: a pack's start
    and end, a model loaded or evicted); the count without one, on every step (one writer; a lost increment between
    two threads is harmless, only a change is read)."""

    PACK_BYTES = 64  # a pack id is at most 40 characters (packs.id)
    WARM_BYTES = 64 * 1024  # the warm models' JSON: ~150 bytes a model

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._lock = ctx.Lock()
        self._pack = ctx.RawArray(ctypes.c_char, self.PACK_BYTES)
        self._warm = ctx.RawArray(ctypes.c_char, self.WARM_BYTES)
        self._progress = ctx.RawValue(ctypes.c_int64, 0)

    def _locked(self) -> bool:
        got = self._lock.acquire(timeout=LOCK_WAIT_S)
        if not got:  # its holder died holding it: write anyway (no one reads half of it)
            log.warning("the heartbeat's shared state stayed locked for %.0fs; writing without the lock", LOCK_WAIT_S)
        return got

    def set_pack(self, pack_id: str | None) -> None:
        """The pack this process runs from now on (None: none); its progress count starts again from 0."""
        raw = (pack_id or "").encode()
        if len(raw) >= self.PACK_BYTES:
            raise ValueError(f"pack id {pack_id!r} is longer than {self.PACK_BYTES - 1} bytes")
        got = self._locked()
        try:
            self._pack.value = raw
            self._progress.value = 0
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

    def progressed(self) -> None:
        self._progress.value += 1

    def read(self) -> tuple[str | None, list[dict[str, Any]] | None, int]:
        """(pack, warm models or None when never told, progress count), as one consistent reading."""
        got = self._locked()
        try:
            pack, warm, progress = self._pack.value, self._warm.value, self._progress.value
        finally:
            if got:
                self._lock.release()
        return pack.decode() or None, json.loads(warm) if warm else None, int(progress)


@dataclass
class ProgressClock:
    """When the pack a heartbeat names last progressed, as its beats see it: the time a beat first saw its current
    (pack, progress count); None without a pack. Measured where the beats are sent, so the scheduler compares it with
    the beat's own `sent_at` (one clock)."""

    seen: tuple[str, int] | None = None
    at: float | None = None

    def observe(self, pack_id: str | None, progress: int, now: float) -> float | None:
        if pack_id is None:
            self.seen, self.at = None, None
            return None
        if self.seen != (pack_id, progress):
            self.seen, self.at = (pack_id, progress), now
        return self.at


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
    pack_id, warm, progress = state.read()
    progressed_at = clock.observe(pack_id, progress, sent_at)
    if pack_id is not None:
        extra.update(progress=progress, progressed_at=progressed_at)
    beat = WorkerHeartbeat(**identity, pack_id=pack_id, incarnation=incarnation.id, started_at=incarnation.started_at,
                           sent_at=sent_at, warm_models=warm, **extra)
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

    Each beat names the pack this process is running (or none; `set_pack`). The scheduler ends any running pack of
    this worker that a beat does not name: the worker names a pack before its `pack.started` and clears it after its
    last report went out, and a beat is timed before it reads the pack (`publish_beat`).

    Each beat also names the registered models this machine can load (when `models` is given: the heartbeat process
    reads the registry itself), the base models it holds loaded (`warm_models`, `worker.model_cache.ModelCache.warm`,
    copied into the shared state every `interval_s` by a thread of the worker: a starved one only delays a change)
    and, with a pack, its progress count and when it last changed (`progressed`).

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
        self.state = BeatState()
        self._clock = ProgressClock()  # for `beat()`; the heartbeat process keeps its own
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = self._ctx.Event()
        self.process: multiprocessing.process.BaseProcess | None = None

    def set_pack(self, pack_id: str | None) -> None:
        self.state.set_pack(pack_id)

    def progressed(self) -> None:
        """The pack made progress (a step, a validation, a phase of its set-up or end): cheap, call it freely."""
        self.state.progressed()

    def _copy_warm(self) -> None:
        if self.warm_models is None:
            return
        try:
            self.state.set_warm(self.warm_models())
        except Exception:  # noqa: BLE001 - the beats go out without them
            log.exception("could not tell which models this worker holds warm")

    def beat(self) -> None:
        self._copy_warm()
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
