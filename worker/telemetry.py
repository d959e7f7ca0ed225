"""The worker's Prometheus metrics (common/telemetry.py defines them): steps, slots, GPU memory and utilisation,
adapters uploaded, where the packs' wall time went. Served on `LORAPLANE_WORKER_METRICS_PORT` (0, the default:
off; one port per worker process when several run on one host)."""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from common.pack_phases import number, phase_seconds
from common.settings import Settings
from common.telemetry import MetricsServer, serve, worker_metrics
from worker.engine import StepStats

log = logging.getLogger(__name__)


def start(settings: Settings, device: torch.device) -> MetricsServer | None:
    """Serves the worker's metrics when a port is set; the GPU's memory and utilisation are read at scrape time
    (nothing is polled between scrapes)."""
    server = serve(worker_metrics().registry, settings.worker_metrics_port, settings.metrics_host, "worker")
    if server is not None and device.type == "cuda":
        metrics = worker_metrics()
        metrics.gpu_memory.labels(device=str(device)).set_function(lambda: float(torch.cuda.memory_allocated(device)))
        utilization = nvml_utilization(device)
        if utilization is not None:
            metrics.gpu_utilization.labels(device=str(device)).set_function(utilization)
    return server


def nvml_utilization(device: torch.device) -> Callable[[], float] | None:
    """A reader of the GPU's utilisation (0 to 1) through NVML, or None where pynvml is not installed or NVML
    does not answer (the metric is then left out)."""
    try:
        pynvml: Any = importlib.import_module("pynvml")  # optional: not a dependency of the worker
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        # By UUID: NVML numbers every GPU of the host, CUDA only the visible ones (CUDA_VISIBLE_DEVICES).
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        handle = (pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid is not None
                  else pynvml.nvmlDeviceGetHandleByIndex(device.index or 0))
    except Exception as exc:  # noqa: BLE001 - NVML missing from the driver, or the device unknown to it
        log.warning("GPU utilisation not measured: NVML did not answer (%s)", exc)
        return None

    def read() -> float:
        try:
            return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0
        except Exception:  # noqa: BLE001 - one failed read must not fail the whole scrape
            return math.nan

    return read


def observe_step(stats: StepStats) -> None:
    """Every pack step (a few microseconds: recorded whether or not anything scrapes)."""
    metrics = worker_metrics()
    metrics.step.observe(stats.seconds)
    metrics.slots_in_use.set(stats.active_slots)
    if stats.seconds > 0:
        metrics.tokens_per_s.set(stats.tokens / stats.seconds)


def pack_ended() -> None:
    """No pack runs: no slot is in use and no token flows until the next one's first step."""
    metrics = worker_metrics()
    metrics.slots_in_use.set(0)
    metrics.tokens_per_s.set(0)


def pack_profiled(phases: dict[str, Any]) -> None:
    """A pack's end: its phases (`pack.profile`'s `phases`, seconds) added to the phase counters, and its share
    of wall time outside training steps set. A phase it did not measure counts nothing."""
    metrics = worker_metrics()
    for name, seconds in phase_seconds(phases).items():
        if seconds is not None and seconds > 0:
            metrics.pack_phase.labels(phase=name.removesuffix("_s")).inc(seconds)
    outside = number(phases.get("outside_steps_frac"))
    if outside is not None:
        metrics.outside_steps.set(outside)


def adapter_uploaded() -> None:
    worker_metrics().adapters_uploaded.inc()


def message_dropped(reason: str) -> None:
    """A pack message or command this worker could not read (common/messages.py)."""
    worker_metrics().messages_dropped.labels(reason=reason).inc()
