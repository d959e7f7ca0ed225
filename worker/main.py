"""`loraplane worker`: one Celery worker process bound to one device, or to several GPUs of its host (a rank process
for each GPU after the first: worker/ranks.py), consuming its own queue."""

from __future__ import annotations

import logging
import socket

import torch

from common.artifacts import get_artifact_store
from common.bus import get_bus
from common.celery import worker_queue
from common.settings import get_settings
from worker import telemetry
from worker.agent import Heartbeat, Incarnation
from worker.availability import ModelAvailability
from worker.model_cache import device_memory, preload_models
from worker.rank_process import rank_main
from worker.ranks import RankConfig, RankPool, free_port
from worker.runner import PackRunner

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


def run_worker(*, gpus: list[int] | None = None, worker_id: str | None = None, loglevel: str = "INFO") -> None:
    """A worker on ``gpus`` (one: a pack on that GPU; several: each pack over all of them, worker/ranks.py)."""
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
    pool, ranks = None, None
    if len(devices) > 1:
        pool = RankPool(RankConfig(
            worker_id=worker_id, devices=tuple(str(d) for d in devices),
            init_method=f"tcp://127.0.0.1:{free_port()}", incarnation=incarnation,
            timeout_s=settings.worker_rank_timeout_s, cpu_threads=settings.worker_cpu_threads,
            preload=settings.worker_preload_models, loglevel=loglevel), entry=rank_main)
        ranks = pool.start()
    # Every beat names the registered models this machine can load (the registry the scheduler published).
    availability = ModelAvailability(bus)
    heartbeat = Heartbeat(bus, settings.heartbeat_interval_s, {
        "worker_id": worker_id, "queue": queue, "device": ",".join(str(d) for d in devices),
        # One GPU's memory, and how many: a pack on this worker holds its base sharded over all of them.
        "memory_bytes": device_memory(device), "gpus": len(devices),
        "max_slots": settings.worker_max_slots * len(devices),
    }, incarnation, models=availability.models)
    runner = PackRunner(worker_id=worker_id, device=device, bus=bus, store=get_artifact_store(),
                        model_cache_dir=settings.resolved_model_cache_dir, heartbeat=heartbeat, ranks=ranks,
                        pool=pool, report_timeout_s=settings.worker_timeout_s)
    from worker.tasks import celery_app, install_runner

    install_runner(runner)
    heartbeat.warm_models = runner.models.warm  # every beat names the base models this worker holds warm
    # Progress bars of model loading end up as WARNING lines in Celery's redirected stderr.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    telemetry.start(settings, device)  # LORAPLANE_WORKER_METRICS_PORT (0: off)
    heartbeat.start()  # beating while models load: the scheduler sees the worker, busy with no pack
    preload_models(runner.model, settings.worker_preload_models,
                   availability.registry() if settings.worker_preload_models else None)
    log.info("worker %s (incarnation %s) on %s consuming %s", worker_id, incarnation.id[:8], device, queue)
    # The solo pool runs the pack in this process, where the model stays loaded between packs and the
    # heartbeat thread dies with it: a killed worker stops beating and the scheduler requeues its trials.
    try:
        celery_app.worker_main([
            "worker", "-Q", queue, "--pool", "solo", "--concurrency", "1", "-n", f"{worker_id}@%h",
            "--loglevel", loglevel, "--without-gossip", "--without-mingle", "--without-heartbeat",
        ])
    finally:
        if pool is not None:
            pool.close()
