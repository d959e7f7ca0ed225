"""The worker's process entry points. `loraplane worker` (`run_worker`): one Celery worker process bound to one device,
or to several GPUs of its host, consuming its own queue; `rank_main`: the process of each GPU after the first,
which the worker's `RankPool` starts (worker/rank_pool.py says what the ranks share and how); and
`pack_process_main`: each pack process of a worker that runs several packs at once (worker/pack_processes.py). The
protocols are apart from this module, so that the pack runner, which uses them, imports no entry point."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from common.artifacts import get_artifact_store
from common.bus import get_bus
from common.celery import consumer_argv, exports_queue, worker_queue
from common.settings import get_settings
from worker import telemetry
from worker.availability import ModelAvailability
from worker.colocation import max_packs_for
from worker.drain import Drain, DrainFlag, listen_for_signals
from worker.heartbeat import BeatProgress, BeatState, Heartbeat, Incarnation
from worker.model_cache import device_memory, preload_models
from worker.pack_processes import PackChannel, PackProcessConfig, PackProcesses, serve
from worker.pack_runner import PackRunner
from worker.rank_pool import RankConfig, RankPool, free_port, join
from worker.sampler import Sampler, SamplerConfig, SamplerProcess

log = logging.getLogger(__name__)


def pick_devices(gpus: list[int] | None) -> list[torch.device]:
    """The worker's devices: one per GPU asked for (none: GPU 0, or the CPU). Without CUDA, a rank on the CPU per
    GPU asked for: a worker over several "GPUs" then runs its ranks on the CPU with gloo (the tests do)."""
    if torch.cuda.is_available():
        return [torch.device(f"cuda:{gpu}") for gpu in gpus or [0]]
    if gpus:
        log.warning("--gpu(s) %s asked for, but CUDA is not available: running on the CPU", gpus)
    return [torch.device("cpu")] * max(1, len(gpus or []))


def default_worker_id(gpus: list[int] | None, device: torch.device) -> str:
    """``<hostname>-gpu0`` for GPU 0, ``<hostname>-gpu0-1`` for GPUs 0 and 1, ``<hostname>-cpu`` without one."""
    suffix = "gpu" + "-".join(str(g) for g in gpus) if gpus else device.type
    return f"{socket.gethostname()}-{suffix}"


def run_worker(*, gpus: list[int] | None = None, worker_id: str | None = None, loglevel: str = "INFO",
               quiet: bool = False) -> None:
    """A worker on ``gpus`` (one: a pack on that GPU; several: each pack over all of them, worker/rank_pool.py).
    ``quiet``: without Celery's start-up banner (`loraplane up` prints its own summary)."""
    settings = get_settings()
    devices = pick_devices(gpus)
    device = devices[0]
    worker_id = worker_id or default_worker_id(gpus, device)
    if settings.worker_cpu_threads:
        torch.set_num_threads(settings.worker_cpu_threads)
    queue = worker_queue(settings, worker_id)
    bus = get_bus()
    # The same worker id comes back after a restart (`<hostname>-gpuN`, or `local` under `loraplane up`): the
    # incarnation tells the scheduler this is a new process, whose predecessor's packs are gone.
    incarnation = Incarnation()
    # Set once SIGTERM drains the worker (worker/drain.py); every process that trains reads it.
    drain_flag = DrainFlag()
    pool = _rank_pool(worker_id, devices, incarnation, drain_flag, loglevel) if len(devices) > 1 else None
    ranks = pool.start() if pool is not None else None
    # Every beat names the registered models this machine can load (the registry the scheduler published).
    availability = ModelAvailability(bus)
    # Several packs at once on one device only, each in a pack process (worker/pack_processes.py).
    max_packs = max_packs_for(settings.worker_max_packs, device_type=device.type, gpus=len(devices))
    memory_bytes = settings.worker_memory_bytes or device_memory(device)
    heartbeat = Heartbeat(bus, settings.heartbeat_interval_s, {
        "worker_id": worker_id, "queue": queue, "device": ",".join(str(d) for d in devices),
        # One GPU's memory, and how many: a pack on this worker holds its base sharded over all of them.
        "memory_bytes": memory_bytes, "gpus": len(devices), "max_packs": max_packs,
        "max_slots": settings.worker_max_slots * len(devices),
    }, incarnation, models=availability.models)
    processes = None
    if max_packs > 1:
        processes = PackProcesses(PackProcessConfig(
            worker_id=worker_id, device=str(device), incarnation=incarnation, make_bus=get_bus,
            make_store=get_artifact_store, model_cache_dir=settings.resolved_model_cache_dir,
            report_timeout_s=settings.worker_timeout_s, processes=max_packs, cpu_threads=settings.worker_cpu_threads,
            preload=settings.worker_preload_models, loglevel=loglevel, drain=drain_flag,
        ), heartbeat.state, memory_bytes, entry=pack_process_main)
        processes.start()
    runner = PackRunner(worker_id=worker_id, device=device, bus=bus, store=get_artifact_store(),
                        model_cache_dir=settings.resolved_model_cache_dir, heartbeat=heartbeat, ranks=ranks,
                        pool=pool, report_timeout_s=settings.worker_timeout_s, max_packs=max_packs,
                        memory_bytes=memory_bytes, processes=processes, drain=drain_flag)
    from worker.celery_app import celery_app, install_runner

    install_runner(runner)
    # Every beat names the base models this worker holds warm (in its pack processes, where it has them).
    heartbeat.warm_models = runner.models.warm if processes is None else processes.warm
    heartbeat.free_memory = runner.packs.free_bytes  # and the memory its running packs left
    # Progress bars of model loading end up as WARNING lines in Celery's redirected stderr.
    hf_logging.disable_progress_bar()
    telemetry.start(settings, device)  # LORAPLANE_WORKER_METRICS_PORT (0: off)
    # Beating from a process of its own (worker/heartbeat.py), which training cannot starve, from now on: while
    # models load the scheduler sees the worker, busy with no pack.
    heartbeat.start()
    sampler = _start_sampler(worker_id, device, loglevel)
    if sampler is not None:  # the device memory its sampler holds, which the planner keeps packs out of
        heartbeat.sampler_bytes = sampler.held_bytes
    if processes is None:  # pack processes preload their own share
        preload_models(runner.model, settings.worker_preload_models,
                       availability.registry() if settings.worker_preload_models else None)
    # SIGTERM (or Ctrl+C) drains: the trials are handed back at their next step and the worker exits within
    # LORAPLANE_WORKER_DRAIN_S; Celery's warm shutdown then waits only for the packs' early ends.
    drain = Drain(drain_flag, settings.worker_drain_s, announce=heartbeat.drain, give_up=heartbeat.abandon)
    listen_for_signals(drain.signalled)
    log.info("worker %s (incarnation %s) on %s consuming %s", worker_id, incarnation.id[:8], device, queue)
    # The solo pool runs the pack in this process, where the model stays loaded between packs (the thread pool, for
    # several packs at once: a thread per pack, waiting for its pack process); the heartbeat process ends with it: a
    # killed worker stops beating and the scheduler requeues its trials.
    try:
        celery_app.worker_main(celery_argv(queue, exports_queue(settings), worker_id=worker_id, max_packs=max_packs,
                                           loglevel=loglevel, quiet=quiet))
    finally:
        heartbeat.stop()
        if pool is not None:
            pool.close()
        if processes is not None:
            processes.close()
        if sampler is not None:
            sampler.close()


def _rank_pool(worker_id: str, devices: list[torch.device], incarnation: Incarnation, drain_flag: DrainFlag,
               loglevel: str) -> RankPool:
    """The processes of a worker's GPUs after the first (worker/rank_pool.py), not yet started."""
    settings = get_settings()
    return RankPool(RankConfig(
        worker_id=worker_id, devices=tuple(str(d) for d in devices),
        init_method=f"tcp://127.0.0.1:{free_port()}", incarnation=incarnation,
        timeout_s=settings.worker_rank_timeout_s, cpu_threads=settings.worker_cpu_threads,
        preload=settings.worker_preload_models, loglevel=loglevel, drain=drain_flag), entry=rank_main)


def _start_sampler(worker_id: str, device: torch.device, loglevel: str) -> SamplerProcess | None:
    """The sampler process that answers sampling requests beside the packs (worker/sampler.py), unless
    `LORAPLANE_WORKER_SAMPLER` is off."""
    settings = get_settings()
    if not settings.worker_sampler:
        return None
    sampler = SamplerProcess(SamplerConfig(
        worker_id=worker_id, device=str(device), make_bus=get_bus, make_store=get_artifact_store,
        model_cache_dir=settings.resolved_model_cache_dir, max_batch=settings.sampler_max_batch,
        max_batch_tokens=settings.sampler_max_batch_tokens, idle_s=settings.sampler_idle_s,
        cpu_threads=settings.worker_cpu_threads, loglevel=loglevel,
    ), entry=sampler_main)
    sampler.start()
    return sampler


def celery_argv(queue: str, exports: str, *, worker_id: str, max_packs: int, loglevel: str, quiet: bool) -> list[str]:
    """The worker's Celery arguments: its own queue, and the exports queue every worker shares (worker/exports.py).
    With the solo pool a merged model is built between packs; the threads pool keeps one thread for it beside the
    packs'."""
    return consumer_argv([queue, exports], name=worker_id, pool="solo" if max_packs == 1 else "threads",
                         concurrency=max_packs + (max_packs > 1), loglevel=loglevel, quiet=quiet)


def rank_main(rank: int, config: RankConfig, packs: Any, ended: Any) -> None:
    """A rank process of a worker over several GPUs: joins the worker's process group, then runs its share of each
    pack rank 0 hands it until it is handed None."""
    _start_child(f"rank{rank}", config.loglevel, config.cpu_threads)
    ranks = join(rank, config)
    bus = get_bus()
    runner = PackRunner(worker_id=config.worker_id, device=torch.device(config.devices[rank]), bus=bus,
                        store=get_artifact_store(), model_cache_dir=get_settings().resolved_model_cache_dir,
                        incarnation=config.incarnation, ranks=ranks, drain=config.drain)
    log.info("rank %d of worker %s on %s", rank, config.worker_id, config.devices[rank])
    if config.preload:
        preload_models(runner.model, config.preload, ModelAvailability(bus).registry())
    while (pack := packs.get()) is not None:
        runner.run_share(pack)
        ended.put((rank, pack.pack_id))
    dist.destroy_process_group()


def pack_process_main(index: int, config: PackProcessConfig, beats: BeatState, channel: PackChannel) -> None:
    """A pack process of a worker that runs several packs at once: runs each pack the worker process hands it, until
    it is handed None (worker/pack_processes.py)."""
    _start_child(f"pack{index}", config.loglevel, config.cpu_threads)
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bus, progress = config.make_bus(), BeatProgress(beats)
    runner = PackRunner(worker_id=config.worker_id, device=device, bus=bus, store=config.make_store(),
                        model_cache_dir=config.model_cache_dir, incarnation=config.incarnation,
                        report_timeout_s=config.report_timeout_s, model_cache_bytes=0, progress=progress,
                        shared_device=lambda: bool(channel.shared.value), drain=config.drain)
    log.info("pack process %d of worker %s on %s", index, config.worker_id, device)
    preload = config.preload_of(index)
    if preload:
        preload_models(runner.model, preload, ModelAvailability(bus).registry())
    serve(runner, channel, progress)


def sampler_main(config: SamplerConfig, stop: Any, held: Any) -> None:
    """The worker's sampler process: answers sampling requests until the worker sets ``stop`` (worker/sampler.py),
    writing what it holds on the device into ``held`` (a shared int64) as it changes."""
    _start_child("sampler", config.loglevel, config.cpu_threads)
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log.info("sampler of worker %s on %s", config.worker_id, device)
    Sampler(config, config.make_bus(), config.make_store(), on_held=lambda n: setattr(held, "value", n)).serve(stop)


def _start_child(name: str, loglevel: str, cpu_threads: int) -> None:
    """What a child process of the worker (a rank, a pack process) sets up first. It ends when its worker says so
    (`RankPool.close`, `PackProcesses.close`) or is gone: not on the signals a terminal or a process manager sends the
    worker's whole process group, on which the worker drains (worker/drain.py: the children read its `DrainFlag`)."""
    logging.basicConfig(level=loglevel, format=f"%(asctime)s {name} %(levelname)s %(name)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    hf_logging.disable_progress_bar()


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when the worker process that started it is gone (killed, so it could not say so)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
