"""A process per pack, on a worker that runs several packs at once (issue 34, `LORAPLANE_WORKER_MAX_PACKS` > 1).

Why processes. Threads of one process were measured first (benchmarks/results/issue34/SUMMARY.md, H200): two packs
side by side did only 0.51-0.79 of the work of the same two one after the other, and the process once segfaulted
with both in it. They shared one CUDA context, one caching allocator and one GIL: a CUDA-graph capture had to hold
off the other pack's device-wide calls, a model eviction's `empty_cache` gave back the other pack's cached blocks,
and each blocking CUDA call waited for the GIL behind the other pack's thread. In a process of its own a pack has its
own context, allocator and interpreter, and a crash takes only that pack.

The worker process starts `max_packs` pack processes and keeps them for its life (spawned, as the ranks of a worker
over several GPUs are: worker/rank_pool.py). Each has its own `PackRunner` and keeps one base model warm, its last
pack's, so that a model stays loaded between packs in the process that ran it. The worker process stays the front:

- Celery hands it each pack on a thread of its own (the threads pool); that thread claims the pack, reserves its
  memory (worker/colocation.py) and names it in the heartbeat, then hands it to an idle pack process
  (`PackProcesses.run`; one that holds the pack's model warm first) and waits for its end;
- the pack process reports all of the pack on the bus itself (`pack.started` to `pack.finished`, under the worker's
  id and incarnation), reads the worker's command stream itself for its pack's stops and back-fills, and bumps its
  pack's progress count in the heartbeat's shared state (`worker.heartbeat.BeatProgress`);
- each pack process publishes its warm model in shared memory (`SharedWarm`): the heartbeat names every process's,
  and a starting pack that needs the room of idle processes' warm models has them dropped first
  (`worker.colocation.idle_models_to_drop`);
- a pack process that dies (a segfault, killed) takes only its pack: the worker process starts another in its
  place, the heartbeat stops naming the pack, and the scheduler requeues its trials from their checkpoints.

The pack processes end with the worker process, killed included. Left out: their step, phase and adapter counters
do not reach the worker's metrics endpoint (worker/telemetry.py), which the worker process serves.
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common.artifacts import LocalArtifactStore
from common.bus import Bus
from common.messages import PackMessage
from worker.colocation import IdleModel, idle_models_to_drop
from worker.drain import DrainFlag
from worker.heartbeat import LOCK_WAIT_S, BeatProgress, BeatState, Incarnation

log = logging.getLogger(__name__)

WATCH_S = 1.0  # how often a thread waiting on a pack process checks that it lives
WARM_EVERY_S = 1.0  # how often a pack process publishes its warm model while a pack runs


@dataclass(frozen=True)
class PackProcessConfig:
    """What a pack process needs (sent to a spawned process: plain values and module-level callables only)."""

    worker_id: str
    device: str
    incarnation: Incarnation  # the worker process's: every pack process reports under it
    make_bus: Callable[[], Bus]  # its own connection to the worker's bus (`common.bus.get_bus`)
    make_store: Callable[[], LocalArtifactStore]  # and to its artifact store
    model_cache_dir: Path
    report_timeout_s: float
    processes: int  # how many (LORAPLANE_WORKER_MAX_PACKS)
    cpu_threads: int = 0  # LORAPLANE_WORKER_CPU_THREADS (0: torch's default)
    preload: str = ""  # LORAPLANE_WORKER_PRELOAD: its models dealt out to the pack processes in turn
    loglevel: str = "INFO"
    drain: DrainFlag | None = None  # set once the worker drains on SIGTERM: each pack process pauses its trials

    def preload_of(self, index: int) -> str:
        """The models pack process ``index`` preloads: every ``processes``-th named (each keeps one)."""
        names = [n.strip() for n in self.preload.split(",") if n.strip()]
        return ",".join(names[index::self.processes])


class SharedWarm:
    """A pack process's warm models (`ModelCache.warm`) as JSON in shared memory, for the worker process."""

    BYTES = 16 * 1024

    def __init__(self, ctx: Any) -> None:
        self._raw = ctx.RawArray(ctypes.c_char, self.BYTES)
        self._lock = ctx.Lock()

    def write(self, warm: list[dict[str, Any]]) -> None:
        raw = json.dumps(warm[:8], separators=(",", ":")).encode()[: self.BYTES - 1]
        got = self._lock.acquire(timeout=LOCK_WAIT_S)  # a reader killed holding it must not hang the writer
        try:
            self._raw.value = raw
        finally:
            if got:
                self._lock.release()

    def written(self) -> bool:
        """Whether its process has said anything yet (it does once it serves: `serve`)."""
        return bool(self._raw.value)

    def read(self) -> list[dict[str, Any]]:
        got = self._lock.acquire(timeout=LOCK_WAIT_S)
        try:
            raw = self._raw.value
        finally:
            if got:
                self._lock.release()
        try:
            warm = json.loads(raw) if raw else []
        except ValueError:  # written without the lock while cut short: nothing said
            return []
        return warm if isinstance(warm, list) else []


@dataclass
class PackChannel:
    """One pack process's ends, shared with it: its commands (``("run", pack, beat slot)``, ``("drop",)``, None to
    end), its replies (``("ended", pack id)``, ``("dropped",)``), its warm model, and whether its pack shared the
    device with another (set by the worker process, read for the pack's profile: the cost fit leaves such packs
    out)."""

    commands: Any
    replies: Any
    warm: SharedWarm
    shared: Any  # a shared c_bool

    @classmethod
    def new(cls, ctx: Any) -> PackChannel:
        return cls(ctx.Queue(), ctx.Queue(), SharedWarm(ctx), ctx.RawValue(ctypes.c_bool, False))


class PackHost(Protocol):
    """What a pack process runs packs with (worker/pack_runner.py `PackRunner`)."""

    def run_here(self, pack: PackMessage) -> None: ...
    def warm_models(self) -> list[dict[str, Any]]: ...
    def drop_warm_models(self) -> None: ...


def serve(host: PackHost, channel: PackChannel, progress: BeatProgress) -> None:
    """A pack process's loop: each command of the worker process in turn, until told to end."""
    stop = threading.Event()

    def publish_warm() -> None:  # the model a pack loads shows in the beats while the pack runs
        while not stop.wait(WARM_EVERY_S):
            channel.warm.write(host.warm_models())

    threading.Thread(target=publish_warm, name="warm-models", daemon=True).start()
    channel.warm.write(host.warm_models())
    try:
        while (command := channel.commands.get()) is not None:
            if command[0] == "drop":
                host.drop_warm_models()
                channel.warm.write(host.warm_models())
                channel.replies.put(("dropped",))
                continue
            _, pack, slot = command
            progress.bind(pack.pack_id, slot)
            try:
                host.run_here(pack)
            finally:
                progress.unbind(pack.pack_id)
                channel.warm.write(host.warm_models())
                channel.replies.put(("ended", pack.pack_id))
    finally:
        stop.set()


@dataclass
class _Process:
    """The worker process's handle on one pack process."""

    index: int
    channel: PackChannel
    process: Any
    running: str | None = None  # the base model of the pack it runs (None: idle)
    pack_id: str | None = None

    def warm(self) -> list[dict[str, Any]]:
        return self.channel.warm.read()

    def holds(self, model: str) -> bool:
        return any(w.get("name") == model for w in self.warm())


class PackProcesses:
    """The worker process's side of its pack processes: starts them, hands each pack to one and waits for its end,
    drops idle processes' warm models where a starting pack needs their room, and replaces a process that died."""

    def __init__(self, config: PackProcessConfig, beats: BeatState, memory_bytes: int,
                 entry: Callable[[int, PackProcessConfig, BeatState, PackChannel], None]) -> None:
        """``entry``: each pack process's main (worker/main.py ``pack_process_main``: passed in, so that this module,
        which the runner uses, does not import the runner)."""
        self.config = config
        self.count = config.processes
        self.beats = beats
        self.memory_bytes = memory_bytes
        self._entry = entry
        self._ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._lock = threading.RLock()  # `_wait` may replace a process while `run` holds it
        self._processes: list[_Process] = []

    def start(self) -> None:
        self._processes = [self._spawn(i) for i in range(self.count)]

    def _spawn(self, index: int) -> _Process:
        # A fresh channel each time: a process killed while it read its queue leaves the queue's lock held.
        channel = PackChannel.new(self._ctx)
        # Not daemonic: a pack process may start processes of its own (torch.compile's workers); each ends with the
        # worker instead (worker/main.py `_exit_with_parent`).
        process = self._ctx.Process(target=self._entry, args=(index, self.config, self.beats, channel),
                                    name=f"pack{index}")
        process.start()
        return _Process(index, channel, process)

    def ready(self) -> bool:
        """Whether every pack process serves (each has loaded what it preloads)."""
        return all(p.channel.warm.written() and p.process.is_alive() for p in self._processes)

    def running(self) -> dict[str, int]:
        """The pack each busy pack process runs, and its process id (operators' logs; the tests kill one)."""
        with self._lock:
            return {p.pack_id: p.process.pid for p in self._processes if p.pack_id is not None}

    def warm(self) -> list[dict[str, Any]]:
        """Every pack process's warm models, most recently used first (what the heartbeat names)."""
        warm = [w for p in list(self._processes) for w in p.warm()]
        return sorted(warm, key=lambda w: -float(w.get("last_used_at") or 0))

    def run(self, pack: PackMessage, beat_slot: int | None, reserved_bytes: int, shared: Callable[[str], bool]) -> None:
        """Runs ``pack`` in an idle pack process and returns once it ended there (its reports went out), or once
        that process died (the pack is lost; another process takes its place). ``reserved_bytes``: every running
        pack's reservation, this one's included; ``shared``: whether a pack has shared the device (the worker's
        ledger, `colocation.RunningPacks.shared`), told to each running pack's process for its profile."""
        model = pack.base_model.name
        with self._lock:
            chosen = self._pick(model)
            idle = [p for p in self._processes if p.running is None and p is not chosen]
            chosen.running, chosen.pack_id = model, pack.pack_id
            for p in self._processes:
                if p.pack_id is not None:
                    p.channel.shared.value = shared(p.pack_id)
            self._make_room(chosen, idle, model, reserved_bytes)
        chosen.channel.commands.put(("run", pack, beat_slot))
        try:
            self._wait(chosen, lambda reply: reply == ("ended", pack.pack_id), f"pack {pack.pack_id}")
        finally:
            with self._lock:
                chosen.running = chosen.pack_id = None

    def _pick(self, model: str) -> _Process:
        """An idle pack process, a dead one replaced first: one holding ``model`` warm, else the one holding
        least."""
        for i, p in enumerate(self._processes):
            if p.running is None and not p.process.is_alive():
                log.error("pack process %d ended (exit status %s) while idle; starting another", p.index,
                          p.process.exitcode)
                self._processes[i] = self._spawn(p.index)
        idle = [p for p in self._processes if p.running is None]
        if not idle:
            raise RuntimeError(f"all {self.count} pack processes are busy (the ledger lets no more packs start)")
        return min(idle, key=lambda p: (not p.holds(model), sum(int(w.get("bytes") or 0) for w in p.warm())))

    def _make_room(self, chosen: _Process, idle: list[_Process], model: str, reserved_bytes: int) -> None:
        """Drops the idle warm models that the running packs' reservations leave no room for (the chosen process's
        copy of ``model`` is part of the pack's own reservation)."""
        held = [IdleModel(p.index, str(w.get("name")), int(w.get("bytes") or 0), float(w.get("last_used_at") or 0))
                for p in [chosen, *idle] for w in p.warm() if not (p is chosen and w.get("name") == model)]
        dropping = {m.process for m in idle_models_to_drop(reserved_bytes, held, memory_bytes=self.memory_bytes)}
        for p in [chosen, *idle]:
            if p.index in dropping:
                log.info("pack process %d drops its warm model: the packs starting need its room", p.index)
                p.channel.commands.put(("drop",))
                if p is not chosen:  # the chosen one drops before it runs the pack (one queue, in order)
                    self._wait(p, lambda reply: reply == ("dropped",), "a model drop")

    def _wait(self, p: _Process, done: Callable[[Any], bool], what: str) -> None:
        while True:
            try:
                reply = p.channel.replies.get(timeout=WATCH_S)
            except queue.Empty:
                if p.process.is_alive():
                    continue
                log.error("pack process %d ended (exit status %s) during %s; starting another in its place (the "
                          "scheduler requeues a lost pack's trials from their checkpoints)", p.index,
                          p.process.exitcode, what)
                with self._lock:
                    self._processes[self._processes.index(p)] = self._spawn(p.index)
                return
            if done(reply):
                return

    def close(self, timeout_s: float = 30.0) -> None:
        for p in self._processes:
            p.channel.commands.put(None)
        for p in self._processes:
            p.process.join(timeout=timeout_s)
