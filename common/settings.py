"""Settings shared by every process, read from the environment (pydantic-settings).

The embedded default needs no variable at all: everything lives under ``LORAPLANE_HOME`` (a SQLite
file, a file-backed bus and Celery broker, a local artifact directory). Setting ``DATABASE_URL``,
``REDIS_URL`` and ``CELERY_BROKER_URL`` switches the same code to the distributed mode.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.egress import EgressPolicy

# How many trials share one pack by default: a worker's slot cap (`LORAPLANE_WORKER_MAX_SLOTS`) and a task's
# `scheduling.max_trials_per_pack` (one value, one default). Measured on one H100 80 GB with the packed engine
# (benchmarks/results/engine_throughput-*-gpu-20261123-packed*.json): 24 trials of the SmolLM2-135M shape (batch 4,
# 96 tokens) peak at 13.5 GiB and a step of 24 costs about what a step of 8 does (the step is host-bound); 32 trials
# of the Llama-3.2-1B shape (batch 1, 512 tokens) peak at 46.9 GiB. So a task of up to 32 trials of a small model is
# one pack; for larger models memory is the limit, and the planner's memory model enforces it
# (scheduler/planning/cost.py).
DEFAULT_MAX_TRIALS_PER_PACK = 32


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore")

    # Where the embedded mode keeps everything (the SQLite database, the bus, the broker's files, artifacts, the model
    # cache, the generated secret key), relative to the directory `loraplane up` runs in unless absolute.
    home: Path = Field(default=Path(".loraplane"), alias="LORAPLANE_HOME")
    database_url: str | None = Field(default=None, alias="DATABASE_URL")
    redis_url: str | None = Field(default=None, alias="REDIS_URL")
    celery_broker_url: str | None = Field(default=None, alias="CELERY_BROKER_URL")
    artifact_dir: Path | None = Field(default=None, alias="LORAPLANE_ARTIFACT_DIR")
    model_cache_dir: Path | None = Field(default=None, alias="LORAPLANE_MODEL_CACHE")
    admin_token: str | None = Field(default=None, alias="LORAPLANE_ADMIN_TOKEN")
    # Encrypts what the database keeps secret (webhook signing secrets; common/secret_box.py): Fernet keys,
    # comma-separated: the first encrypts, every one decrypts (rotation: put a new key first, run
    # `loraplane rotate-secrets`, then drop the old one). The API and the scheduler must have the same keys: unset
    # in the distributed mode, they refuse to start; in the embedded mode, one is generated into LORAPLANE_HOME.
    secret_key: SecretStr | None = Field(default=None, alias="LORAPLANE_SECRET_KEY")
    # Webhooks and experiment trackers reach only public addresses (common/egress.py). Comma-separated networks
    # (CIDR), addresses and host names that may be reached although they are not public, e.g. an in-cluster
    # receiver or MLflow server. Empty: none.
    webhook_allowed_networks: str = Field(default="", alias="LORAPLANE_WEBHOOK_ALLOWED_NETWORKS")
    # Experiment trackers (scheduler/service/trackers.py): how often a run in step with its trial is looked at again,
    # and the longest wait between attempts while a tracker is down (the waits double from 5 s up to it; the
    # attempts go on until it answers: nothing is dropped).
    tracker_sync_s: float = Field(default=2.0, gt=0, alias="LORAPLANE_TRACKER_SYNC_S")
    tracker_retry_max_s: float = Field(default=600.0, gt=0, alias="LORAPLANE_TRACKER_RETRY_MAX_S")
    # Prefixes every Redis key and Celery queue, so several deployments (or test runs) share one Redis.
    namespace: str = Field(default="loraplane", alias="LORAPLANE_NAMESPACE")

    heartbeat_interval_s: float = Field(default=5.0, alias="LORAPLANE_HEARTBEAT_S")
    # A worker silent for this long is declared lost and its trials go back to pending.
    worker_timeout_s: float = Field(default=30.0, alias="LORAPLANE_WORKER_TIMEOUT_S")
    # A worker whose beats arrive but whose pack has not progressed (no step, validation or phase) for this long is
    # hung: the pack is lost, its trials go back to pending, and the worker gets no pack while its beats say so.
    # Generous: a model's download and load, or a long validation, count as one phase.
    worker_stall_s: float = Field(default=3600.0, alias="LORAPLANE_WORKER_STALL_S")
    # SIGTERM drains a worker (worker/drain.py): its trials checkpoint at their next step and are handed back
    # (paused) for another worker to resume; it exits within this many seconds of the signal whatever is left, its
    # trials not yet handed back then requeued from their last checkpoint. Within Kubernetes' default grace period
    # of 30 s, which the manifests set (deploy/k8s/worker.yaml, docker-compose.yml's stop_grace_period).
    worker_drain_s: float = Field(default=25.0, gt=0, le=30, alias="LORAPLANE_WORKER_DRAIN_S")
    # The scheduler replans at least this often even when no event arrives (Redis is not the source of truth).
    scheduler_tick_s: float = Field(default=2.0, alias="LORAPLANE_SCHEDULER_TICK_S")
    # Transactions the scheduler applies a batch of reports in at once, each the reports of some workers (one on
    # SQLite, whose writers take turns): ingest waits on the database far more than it computes.
    scheduler_ingest_threads: int = Field(default=4, ge=1, le=32, alias="LORAPLANE_SCHEDULER_INGEST_THREADS")
    # A worker's loss (its process died or restarted, its heartbeat stopped, its whole pack failed) costs its trials
    # no attempt: they go back to pending and wait this long before they may be placed again, doubled for each
    # worker loss of the trial, up to the max (scheduler/planning/faults.py). Time for a crashed worker to come back
    # or stay away before the trial lands on it again.
    requeue_backoff_s: float = Field(default=5.0, ge=0, alias="LORAPLANE_REQUEUE_BACKOFF_S")
    requeue_backoff_max_s: float = Field(default=300.0, ge=0, alias="LORAPLANE_REQUEUE_BACKOFF_MAX_S")
    # A worker id that loses this many packs within the window is quarantined: no packs for QUARANTINE_S, doubled
    # for each quarantine in a row (until a pack ends well on it), up to the max. A crash-looping worker then
    # stops taking every tenant's trials down with it; the admin views and a metric show it.
    worker_quarantine_losses: int = Field(default=3, ge=1, alias="LORAPLANE_WORKER_QUARANTINE_LOSSES")
    worker_quarantine_window_s: float = Field(default=600.0, gt=0, alias="LORAPLANE_WORKER_QUARANTINE_WINDOW_S")
    worker_quarantine_s: float = Field(default=60.0, ge=0, alias="LORAPLANE_WORKER_QUARANTINE_S")
    worker_quarantine_max_s: float = Field(default=1800.0, ge=0, alias="LORAPLANE_WORKER_QUARANTINE_MAX_S")
    # Preemption with a time slice (issue 34): a pack that has run its slice may be paused at its members' next
    # checkpoint for another tenant whose trials cannot start and who has had less GPU time per weight over the
    # window; a trial at most max_pauses times. Unset: the defaults of scheduler/planning/fairness.py
    # `FairnessPolicy`, where they are explained. LORAPLANE_PREEMPT=false: a pack runs to its end.
    preempt: bool = Field(default=True, alias="LORAPLANE_PREEMPT")
    preempt_min_slice_s: float | None = Field(default=None, ge=0, alias="LORAPLANE_PREEMPT_MIN_SLICE_S")
    fair_window_s: float | None = Field(default=None, gt=0, alias="LORAPLANE_FAIR_WINDOW_S")
    preempt_max_pauses: int | None = Field(default=None, ge=0, alias="LORAPLANE_PREEMPT_MAX_PAUSES")
    # The most trials one pack of this worker holds per GPU (a worker over n GPUs announces n times it): one name
    # for it, as the variable, the heartbeat's `max_slots` and the workers table's column say.
    worker_max_slots: int = Field(default=DEFAULT_MAX_TRIALS_PER_PACK, ge=1, alias="LORAPLANE_WORKER_MAX_SLOTS")
    # How many packs a worker on one device runs at once, each of another base model in a pack process of its own, as
    # far as their planned memory fits beside each other (docs/operator-guide.md, "Several packs on one GPU").
    # 0 (the default): 2 on a GPU, 1 on the CPU (where packs would only share its cores); a worker over several GPUs
    # runs one. On an H200 two packs side by side had the short task done 1.77x sooner than waiting its turn, at
    # 1.04x the throughput of one after the other (benchmarks/results/issue34/SUMMARY.md).
    worker_max_packs: int = Field(default=0, ge=0, le=8, alias="LORAPLANE_WORKER_MAX_PACKS")
    # Sampling from trained adapters (worker/sampler.py): whether a worker starts its sampler process, how many
    # requests it decodes together at most (and the KV cache they may hold), and how long it keeps a base model
    # loaded with no request for it.
    worker_sampler: bool = Field(default=True, alias="LORAPLANE_WORKER_SAMPLER")
    sampler_max_batch: int = Field(default=32, ge=1, le=256, alias="LORAPLANE_SAMPLER_MAX_BATCH")
    # The KV cache one batch may hold, in positions (rows x (longest prompt + most new tokens)): more waits for the
    # next batch. 65536 positions are 8.6 GB for Llama-3.1-8B in bf16, 2 GB for 1B.
    sampler_max_batch_tokens: int = Field(default=65536, ge=1, alias="LORAPLANE_SAMPLER_MAX_BATCH_TOKENS")
    sampler_idle_s: float = Field(default=300.0, gt=0, alias="LORAPLANE_SAMPLER_IDLE_S")
    # How long the API waits for a sampling request's answer (a cold base model's load included), and how many of a
    # tenant's sampling requests one API process holds open at once (more: 429).
    sampling_timeout_s: float = Field(default=300.0, gt=0, alias="LORAPLANE_SAMPLING_TIMEOUT_S")
    sampling_max_inflight: int = Field(default=16, ge=1, alias="LORAPLANE_SAMPLING_MAX_INFLIGHT")
    # The memory a worker plans its packs in and reports (0: its device's: one GPU's, or the host's).
    worker_memory_bytes: int = Field(default=0, ge=0, alias="LORAPLANE_WORKER_MEMORY_BYTES")
    # A worker over several GPUs (`--gpus`): how long one of its ranks waits for the others in an agreement or a
    # collective before the pack fails (worker/rank_pool.py). It covers the slowest rank's model load before a pack.
    worker_rank_timeout_s: float = Field(default=600.0, gt=0, alias="LORAPLANE_WORKER_RANK_TIMEOUT_S")
    # Registry names (comma-separated) of base models a worker loads at start, before its first pack: the
    # first pack of a task then pays no model load (tens of seconds for a GGUF model).
    worker_preload_models: str = Field(default="", alias="LORAPLANE_WORKER_PRELOAD")
    # The bytes of loaded base models (parameters and buffers) a worker keeps warm between packs on its device
    # (worker/model_cache.py): past it, the least recently used go. 0: half of the device's memory.
    worker_model_cache_bytes: int = Field(default=0, ge=0, alias="LORAPLANE_WORKER_MODEL_CACHE_BYTES")
    # How often a pack snapshots its training trials (adapter and optimizer state, to host memory, without stalling
    # training) for its writer to persist as checkpoints: a killed worker's trials resume from one no older than
    # this (plus its write). Pauses are checkpointed whatever it says. 0: at every step.
    checkpoint_interval_s: float = Field(default=60.0, ge=0, alias="LORAPLANE_CHECKPOINT_INTERVAL_S")
    # torch's CPU threads in a worker process: its host work is many small ops a step (batch packing, launch
    # tables), which gain nothing from more threads, and several workers on one host would otherwise each
    # start one thread per core and contend (0: torch's own default).
    worker_cpu_threads: int = Field(default=2, ge=0, alias="LORAPLANE_WORKER_CPU_THREADS")
    # cpsat: CP-SAT over all pending trials and workers; greedy: the first-fit planner alone, which is also CP-SAT's
    # hint and fallback. The same rules run before and after either (scheduler/planning/placement.py).
    planner: Literal["cpsat", "greedy"] = Field(default="cpsat", alias="LORAPLANE_PLANNER")
    planner_time_limit_s: float = Field(default=1.0, gt=0, alias="LORAPLANE_PLANNER_TIME_LIMIT_S")
    # Prometheus metrics of the scheduler and of a worker, each on its own port (0: off; several workers on one
    # host need one port each). Served without authentication on `metrics_host` (common/telemetry.py); the
    # API's are at its own `GET /metrics`, behind the admin token.
    scheduler_metrics_port: int = Field(default=0, ge=0, le=65535, alias="LORAPLANE_SCHEDULER_METRICS_PORT")
    worker_metrics_port: int = Field(default=0, ge=0, le=65535, alias="LORAPLANE_WORKER_METRICS_PORT")
    metrics_host: str = Field(default="0.0.0.0", alias="LORAPLANE_METRICS_HOST")

    default_max_concurrent_trials: int = Field(default=64, alias="LORAPLANE_DEFAULT_MAX_CONCURRENT_TRIALS")
    default_max_trials_per_task: int = Field(default=32, alias="LORAPLANE_DEFAULT_MAX_TRIALS_PER_TASK")
    default_max_file_bytes: int = Field(default=50 * 1024 * 1024, alias="LORAPLANE_DEFAULT_MAX_FILE_BYTES")
    # A tenant's storage quota: the bytes and the number of its live (not deleted) files.
    default_max_storage_bytes: int = Field(default=10 * 1024**3, alias="LORAPLANE_DEFAULT_MAX_STORAGE_BYTES")
    default_max_files: int = Field(default=1000, alias="LORAPLANE_DEFAULT_MAX_FILES")
    # The largest request body the API reads whole (every route but the streamed upload, POST /v1/files):
    # a task body is a few kilobytes; without a bound one request could make an API process hold gigabytes.
    max_request_bytes: int = Field(default=1024 * 1024, ge=1024, alias="LORAPLANE_MAX_REQUEST_BYTES")
    # The API's access log, a line per request (`loraplane up|api --access-log` turns it on too): off by default,
    # since the dashboard polls every few seconds and its lines would bury everything else.
    access_log: bool = Field(default=False, alias="LORAPLANE_ACCESS_LOG")
    # Each API server process's address space, in MiB (0: no limit; loraplane/cli.py sets it): a request that still
    # exhausts memory fails alone, with a MemoryError answered as a 500 or the process ended and started again, never
    # the scheduler's or the worker's memory (issue 52). The API uses ~1.5 GiB of mostly unbacked virtual memory
    # (thread stacks, allocator arenas, libraries); 4 GiB leaves it room and bounds what one request can take.
    api_memory_limit_mb: int = Field(default=4096, ge=0, alias="LORAPLANE_API_MEMORY_LIMIT_MB")

    @field_validator("database_url")
    @classmethod
    def _psycopg3_driver(cls, url: str | None) -> str | None:
        # Users paste plain postgres URLs; SQLAlchemy would pick psycopg2, which we do not ship.
        if url and url.startswith(("postgres://", "postgresql://")):
            return "postgresql+psycopg://" + url.split("://", 1)[1]
        return url

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _allow_list_parses(cls, text: str) -> str:
        EgressPolicy.parse(text)  # a mistyped entry fails at start, naming it, not at the first webhook
        return text

    @property
    def webhook_egress_policy(self) -> EgressPolicy:
        return EgressPolicy.parse(self.webhook_allowed_networks)

    @property
    def embedded(self) -> bool:
        """No DATABASE_URL: the database (and everything else) lives under LORAPLANE_HOME."""
        return not self.database_url

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'loraplane.db').resolve()}"

    @property
    def resolved_artifact_dir(self) -> Path:
        return (self.artifact_dir or self.home / "artifacts").resolve()

    @property
    def resolved_model_cache_dir(self) -> Path:
        return (self.model_cache_dir or self.home / "models").resolve()

    @property
    def resolved_broker_url(self) -> str:
        if self.celery_broker_url:
            return self.celery_broker_url
        if self.redis_url:
            return self.redis_url
        return "filesystem://"

    @property
    def broker_dir(self) -> Path:
        return (self.home / "broker").resolve()

    @property
    def bus_path(self) -> Path:
        return (self.home / "bus.db").resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()
