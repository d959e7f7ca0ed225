"""`loraplane worker`: one Celery worker process bound to one device, consuming its own queue."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import torch

from common.artifacts import get_artifact_store
from common.bus import get_bus
from common.celery import worker_queue
from common.registry import DEFAULT_MODELS
from common.settings import get_settings
from worker import telemetry
from worker.agent import Heartbeat, Incarnation
from worker.availability import ModelAvailability
from worker.engine import ModelSource
from worker.runner import PackRunner

log = logging.getLogger(__name__)


def pick_device(gpu: int | None) -> torch.device:
    if torch.cuda.is_available():
        return torch.device(f"cuda:{gpu or 0}")
    if gpu is not None:
        log.warning("--gpu %s asked for, but CUDA is not available: running on the CPU", gpu)
    return torch.device("cpu")


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def preload_models(load: Callable[[ModelSource], object], names: str,
                   registry: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Load the named registry models now with ``load`` (``PackRunner.model``, which keeps them); ``names`` is
    ``LORAPLANE_WORKER_PRELOAD``. A name is looked up in ``registry`` (the one the scheduler published, with
    the models an operator registered), then among the default models; an unknown name is logged and skipped,
    and so is a model that fails to load (its packs will say why)."""
    sources = {m.name: ModelSource(name=m.name, kind=m.kind, path=m.path, package=m.package, gguf_file=m.gguf_file)
               for m in DEFAULT_MODELS}
    for name, fields in (registry or {}).items():
        sources[name] = ModelSource(**fields)  # common.registry.model_source_fields, as a pack message carries them
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in sources:
            log.warning("LORAPLANE_WORKER_PRELOAD: %r is not a registered model; not preloaded", name)
            continue
        try:
            load(sources[name])
        except Exception:  # noqa: BLE001 - the worker still serves the models it can load
            log.exception("LORAPLANE_WORKER_PRELOAD: %r could not be loaded", name)


def run_worker(*, gpu: int | None = None, worker_id: str | None = None, loglevel: str = "INFO") -> None:
    settings = get_settings()
    device = pick_device(gpu)
    suffix = f"gpu{gpu}" if gpu is not None else device.type
    worker_id = worker_id or f"{socket.gethostname()}-{suffix}"
    if settings.worker_cpu_threads:
        torch.set_num_threads(settings.worker_cpu_threads)
    queue = worker_queue(settings, worker_id)
    bus = get_bus()
    # The same worker id comes back after a restart (`<hostname>-gpuN`, or `local` under `loraplane up`): the
    # incarnation tells the scheduler this is a new process, whose predecessor's packs are gone.
    incarnation = Incarnation()
    # Every beat names the registered models this machine can load (the registry the scheduler published).
    availability = ModelAvailability(bus)
    heartbeat = Heartbeat(bus, settings.heartbeat_interval_s, {
        "worker_id": worker_id, "queue": queue, "device": str(device), "memory_bytes": device_memory(device),
        "max_slots": settings.worker_max_slots,
    }, incarnation, models=availability.models)
    runner = PackRunner(worker_id=worker_id, device=device, bus=bus, store=get_artifact_store(),
                        model_cache_dir=settings.resolved_model_cache_dir, heartbeat=heartbeat,
                        report_timeout_s=settings.worker_timeout_s)
    from worker.tasks import celery_app, install_runner

    install_runner(runner)
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
    celery_app.worker_main([
        "worker", "-Q", queue, "--pool", "solo", "--concurrency", "1", "-n", f"{worker_id}@%h",
        "--loglevel", loglevel, "--without-gossip", "--without-mingle", "--without-heartbeat",
    ])
