"""`loraplane worker --hollow --count N`: N hollow workers in one process (worker/hollow/__init__.py).

Each has what a real worker process has of its own: its worker id (``<prefix>-<i>``, the same after a restart), a new
`Incarnation` per start, its identity (a ``hollow:<GPU kind>`` device, its memory, slots and most packs), its beat
state, command inbox, co-location ledger and `PackRunner`. What they share, so that each costs little: one heartbeat
thread beating for all of them (a real worker beats from a process of its own, which training cannot starve; here a
step is a sleep), one Celery consumer (a threads pool over all their queues, each pack routed to the runner of the
worker it names), the bus and artifact store clients, the recorded curves, and one drain on SIGTERM.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery

from common.artifacts import get_artifact_store
from common.bus import get_bus
from common.celery import RUN_PACK_TASK, consumer_argv, make_celery, worker_queue
from common.messages import parse_pack
from common.settings import get_settings
from worker import telemetry
from worker.drain import Drain, DrainFlag, listen_for_signals
from worker.heartbeat import Heartbeat, Incarnation
from worker.hollow.curves import DEFAULT_CURVES_DIR, load_library
from worker.hollow.engine import HollowEngine
from worker.hollow.runner import hollow_runner
from worker.hollow.timing import TimingModel
from worker.pack_runner import PackRunner

log = logging.getLogger(__name__)

GB = 10**9  # --memory-gb counts as GPU makers do (an H200's "141 GB")


@dataclass(frozen=True)
class HollowOptions:
    """What `loraplane worker --hollow` takes (see `loraplane worker --help`)."""

    count: int = 1
    prefix: str = ""  # "": <hostname>-hollow
    gpu_kind: str = "H200"
    memory_gb: float = 141.0
    slots: int = 32
    max_packs: int = 2
    time_scale: float = 1.0
    noise: float = 0.05
    curves_dir: Path = DEFAULT_CURVES_DIR

    def worker_ids(self) -> list[str]:
        prefix = self.prefix or f"{socket.gethostname()}-hollow"
        return [f"{prefix}-{i}" for i in range(self.count)]


@dataclass
class HollowWorker:
    worker_id: str
    queue: str
    heartbeat: Heartbeat
    runner: PackRunner


def build_workers(options: HollowOptions, drain: DrainFlag) -> list[HollowWorker]:
    """The process's hollow workers, each with a new incarnation, none beating yet."""
    if options.count < 1 or options.slots < 1 or options.max_packs < 1 or options.memory_gb <= 0:
        raise ValueError(f"count, slots and max_packs must be at least 1 and memory positive: {options}")
    settings, bus, store = get_settings(), get_bus(), get_artifact_store()
    engine = HollowEngine(load_library(options.curves_dir), TimingModel(options.time_scale, options.noise))
    memory_bytes, device = int(options.memory_gb * GB), f"hollow:{options.gpu_kind}"
    workers = []
    for worker_id in options.worker_ids():
        queue = worker_queue(settings, worker_id)
        # No `models`: the beats name none, which the scheduler takes as every model (a hollow worker loads none).
        heartbeat = Heartbeat(bus, settings.heartbeat_interval_s, {
            "worker_id": worker_id, "queue": queue, "device": device, "memory_bytes": memory_bytes, "gpus": 1,
            "max_packs": options.max_packs, "max_slots": options.slots,
        }, Incarnation())
        runner = hollow_runner(worker_id=worker_id, bus=bus, store=store, heartbeat=heartbeat, engine=engine,
                               memory_bytes=memory_bytes, max_packs=options.max_packs, drain=drain,
                               report_timeout_s=settings.worker_timeout_s,
                               model_cache_dir=settings.resolved_model_cache_dir, device=device)
        heartbeat.warm_models = runner.models.warm
        heartbeat.free_memory = runner.packs.free_bytes
        workers.append(HollowWorker(worker_id, queue, heartbeat, runner))
    return workers


class Beats:
    """One thread beating for every hollow worker of the process, each `interval_s` (`Heartbeat.beat` of each in
    turn; a beat that fails is logged and the next round tries again). It ends with the process, killed included:
    the scheduler then sees every one of them go silent."""

    def __init__(self, workers: list[HollowWorker], interval_s: float) -> None:
        self.workers = workers
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hollow-beats", daemon=True)

    def start(self) -> None:
        self.beat_all()  # seen at once, before Celery starts consuming
        self._thread.start()

    def beat_all(self) -> None:
        for w in self.workers:
            if self.stopped.is_set():
                return
            try:
                w.heartbeat.beat()
            except Exception as exc:  # noqa: BLE001 - the bus may blink; the next round beats again
                log.warning("heartbeat of %s failed: %s", w.worker_id, exc)

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.beat_all()

    def stop(self) -> None:
        self.stopped.set()


def hollow_celery(runners: dict[str, PackRunner]) -> Celery:
    """A Celery app of this process whose `run_pack` hands each pack to the runner of the worker it names (a pack
    for a worker this process does not run is logged and dropped: the scheduler, hearing nothing, sends it again)."""
    app = make_celery(get_settings())

    @app.task(name=RUN_PACK_TASK, acks_late=False)
    def run_pack(*, pack: dict[str, Any]) -> None:
        message = parse_pack(pack, on_drop=telemetry.message_dropped)
        if message is None:
            return
        runner = runners.get(message.worker_id)
        if runner is None:
            log.error("pack %s is for worker %s, which this process does not run", message.pack_id,
                      message.worker_id)
            return
        runner.run(message)

    return app


def celery_argv(queues: list[str], options: HollowOptions, loglevel: str, quiet: bool) -> list[str]:
    """Every hollow worker's queue (not the exports queue: a hollow worker builds no export), a thread for each pack
    they may run at once."""
    return consumer_argv(queues, name=options.worker_ids()[0].rsplit("-", 1)[0], pool="threads",
                         concurrency=options.count * options.max_packs, loglevel=loglevel, quiet=quiet)


def run_hollow_workers(options: HollowOptions, *, loglevel: str = "INFO", quiet: bool = False) -> None:
    """Runs ``options.count`` hollow workers in this process until it is stopped (SIGTERM drains all of them, as
    worker/drain.py drains a real one)."""
    settings = get_settings()
    flag = DrainFlag()
    workers = build_workers(options, flag)
    beats = Beats(workers, settings.heartbeat_interval_s)

    def give_up() -> None:
        beats.stop()
        for w in workers:
            w.heartbeat.abandon()

    drain = Drain(flag, settings.worker_drain_s, announce=_each(workers, lambda w: w.heartbeat.drain()),
                  give_up=give_up)
    listen_for_signals(drain.signalled)
    app = hollow_celery({w.worker_id: w.runner for w in workers})
    beats.start()
    log.info("%d hollow workers (%s .. %s) on %s, time scale %g, noise %g", len(workers), workers[0].worker_id,
             workers[-1].worker_id, workers[0].heartbeat.identity["device"], options.time_scale, options.noise)
    try:
        app.worker_main(celery_argv([w.queue for w in workers], options, loglevel, quiet))
    finally:
        beats.stop()


def _each(workers: list[HollowWorker], act: Callable[[HollowWorker], None]) -> Callable[[], None]:
    def run() -> None:
        for w in workers:
            act(w)
    return run
