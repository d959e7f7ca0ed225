"""Prometheus metrics of every loraplane process: their one definition each, and how they are served.

Each process kind has its own registry, built on first use (`api_metrics`, `scheduler_metrics`,
`worker_metrics`): `loraplane up` runs the API and the scheduler in one process, and each endpoint shows only
its own metrics; a process that never touches a kind's metrics creates none of them (in multiprocess mode a
metric created is a file written).

- API: `GET /metrics`, the admin token as Bearer (api/telemetry.py). `loraplane api --workers N` runs N
  processes; the parent gives them one fresh directory in `PROMETHEUS_MULTIPROC_DIR` (removed when it exits),
  each process writes its values there, and a scrape answered by any process sums all of them
  (`render_api_metrics`).
- Scheduler and worker: one process each, served on their own port by `serve` (`LORAPLANE_SCHEDULER_METRICS_PORT`,
  `LORAPLANE_WORKER_METRICS_PORT`; 0, the default, is off), without authentication.

No torch and no api/ imports here: every process kind imports this module.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
)

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # the variable prometheus_client itself reads at import
CONTENT_TYPE = CONTENT_TYPE_LATEST
UNMATCHED_ROUTE = "unmatched"  # the route label of a request no route matched (a 404): raw paths are unbounded

# Request latencies: 5 ms (a health probe) to 30 s (an upload of a large file).
API_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A replan: milliseconds for the greedy planner, up to the CP-SAT time limit (1 s by default) and beyond.
REPLAN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
# Report send -> ingest: one scheduler tick (2 s by default) is normal, tens of seconds is a backlog.
INGEST_LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
# A pack step: ~10 ms on a GPU for a tiny model to seconds for a large pack on the CPU.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class ApiMetrics:
    registry: CollectorRegistry
    requests: Counter  # labels: route (the template, `/v1/tasks/{task_id}`), method, status
    latency: Histogram  # labels: route, method; until the response's headers are sent (a stream's body is not)


@dataclass(frozen=True)
class SchedulerMetrics:
    registry: CollectorRegistry
    replan: Histogram
    trials: Gauge  # label: state (the live ones: pending, running, waiting)
    pending: Gauge  # label: base_model
    packs_running: Gauge
    ingest_lag: Histogram
    reports: Counter
    workers_quarantined: Gauge  # alive workers the planners give no pack now (scheduler/service/faults.py)
    quarantines: Counter
    messages_dropped: Counter  # label: reason (why common/messages.py dropped them)


@dataclass(frozen=True)
class WorkerMetrics:
    registry: CollectorRegistry
    step: Histogram
    tokens_per_s: Gauge
    slots_in_use: Gauge
    gpu_memory: Gauge  # label: device (`cuda:0`); a labelled gauge with no child has no sample, as on the CPU
    gpu_utilization: Gauge  # label: device
    adapters_uploaded: Counter
    pack_phase: Counter  # label: phase (common/pack_phases.py's names less `_s`)
    outside_steps: Gauge
    messages_dropped: Counter  # label: reason


@cache
def api_metrics() -> ApiMetrics:
    registry = CollectorRegistry(auto_describe=True)
    return ApiMetrics(
        registry=registry,
        requests=Counter("loraplane_api_requests", "HTTP requests answered, by route template, method and status.",
                         ["route", "method", "status"], registry=registry),
        latency=Histogram("loraplane_api_request_duration_seconds",
                          "Time from a request's arrival to its response's headers, by route template and method.",
                          ["route", "method"], buckets=API_BUCKETS, registry=registry),
    )


@cache
def scheduler_metrics() -> SchedulerMetrics:
    registry = CollectorRegistry(auto_describe=True)
    return SchedulerMetrics(
        registry=registry,
        replan=Histogram("loraplane_scheduler_replan_seconds", "Time one replan took (snapshot to recorded plan).",
                         buckets=REPLAN_BUCKETS, registry=registry),
        trials=Gauge("loraplane_scheduler_trials", "Trials in each live state (pending, running, waiting).",
                     ["state"], registry=registry),
        pending=Gauge("loraplane_scheduler_pending_trials", "Trials waiting for a slot, by base model.",
                      ["base_model"], registry=registry),
        packs_running=Gauge("loraplane_scheduler_packs_running", "Packs a worker runs now.", registry=registry),
        ingest_lag=Histogram("loraplane_scheduler_ingest_lag_seconds",
                             "Seconds from a worker message's `sent_at` (worker clock) to its ingestion.",
                             buckets=INGEST_LAG_BUCKETS, registry=registry),
        reports=Counter("loraplane_scheduler_messages_ingested", "Bus messages ingested, heartbeats included.",
                        registry=registry),
        workers_quarantined=Gauge("loraplane_scheduler_workers_quarantined", "Alive workers in quarantine now "
                                  "(they lost packs repeatedly: the planners give them none until it ends).",
                                  registry=registry),
        quarantines=Counter("loraplane_scheduler_worker_quarantines", "Quarantines begun (a worker that lost "
                            "LORAPLANE_WORKER_QUARANTINE_LOSSES packs within the window).", registry=registry),
        messages_dropped=_messages_dropped(registry, "scheduler"),
    )


@cache
def worker_metrics() -> WorkerMetrics:
    registry = CollectorRegistry(auto_describe=True)
    return WorkerMetrics(
        registry=registry,
        step=Histogram("loraplane_worker_step_seconds", "Wall time of one pack step (every slot's forward and "
                       "backward, the optimizer update, the sync).", buckets=STEP_BUCKETS, registry=registry),
        tokens_per_s=Gauge("loraplane_worker_tokens_per_second", "Real (non-padding) tokens per second of the "
                           "latest step.", registry=registry),
        slots_in_use=Gauge("loraplane_worker_slots_in_use", "Slots that trained in the latest step (0 between "
                           "packs).", registry=registry),
        gpu_memory=Gauge("loraplane_worker_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated of the "
                         "worker's device, read at scrape time (no sample on the CPU).", ["device"],
                         registry=registry),
        gpu_utilization=Gauge("loraplane_worker_gpu_utilization_ratio", "NVML's utilisation of the worker's GPU "
                              "(0 to 1), read at scrape time (no sample without pynvml).", ["device"],
                              registry=registry),
        adapters_uploaded=Counter("loraplane_worker_adapters_uploaded", "Trial adapters written to the artifact "
                                  "store.", registry=registry),
        pack_phase=Counter("loraplane_worker_pack_phase_seconds", "Seconds of the packs' wall time in each phase, "
                           "counted at each pack's end (every phase but persist, the writer thread's, adds up to "
                           "the packs' wall time).", ["phase"], registry=registry),
        outside_steps=Gauge("loraplane_worker_last_pack_outside_steps_ratio", "The share of the last pack's wall "
                            "time outside training steps (0 to 1).", registry=registry),
        messages_dropped=_messages_dropped(registry, "worker"),
    )


def _messages_dropped(registry: CollectorRegistry, side: str) -> Counter:
    return Counter(f"loraplane_{side}_bus_messages_dropped", "Bus messages dropped unread (common/messages.py), by "
                   "why: of an unknown type or version, or malformed.", ["reason"], registry=registry)


def multiprocess_dir() -> Path | None:
    """The directory the API processes share their values in, when they run in multiprocess mode."""
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


def render_api_metrics(shared_dir: Path | None = None) -> bytes:
    """The API's metrics in the text exposition format: the sum over every process writing to ``shared_dir``
    (default: `PROMETHEUS_MULTIPROC_DIR`), else this process's own."""
    shared_dir = shared_dir or multiprocess_dir()
    if shared_dir is None:
        return generate_latest(api_metrics().registry)
    # A fresh registry per scrape, as prometheus_client asks: the collector reads every process's files now.
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(shared_dir))
    return generate_latest(registry)


def create_multiprocess_dir() -> Path:
    """A fresh, empty, owner-only directory for one run's API processes (values left from an earlier run
    would be summed in)."""
    return Path(tempfile.mkdtemp(prefix="loraplane-metrics-"))


def mark_process_dead(pid: int, shared_dir: Path) -> None:
    """A server process exited: its live gauges are dropped (its counters stay in the sums: they only grow)."""
    multiprocess.mark_process_dead(pid, str(shared_dir))


def remove_multiprocess_dir(shared_dir: Path) -> None:
    shutil.rmtree(shared_dir, ignore_errors=True)


@dataclass
class MetricsServer:
    """An HTTP server of one registry on its own thread (`serve`)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(registry: CollectorRegistry, port: int, host: str, what: str) -> MetricsServer | None:
    """Serves ``registry`` at http://host:port/ (any path) on a daemon thread; port 0 is off (None)."""
    if port == 0:
        return None
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("%s metrics on http://%s:%d/metrics", what, host, port)
    return MetricsServer(server, thread)
