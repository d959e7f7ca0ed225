"""SQLAlchemy 2 models: the system of record. Every process may read them; only the API and the
scheduler write (workers report through the bus)."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from common.settings import DEFAULT_MAX_TRIALS_PER_PACK, get_settings
from common.task_spec import TaskSpec

# SQLite only autoincrements an INTEGER PRIMARY KEY; Postgres gets a bigint identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """A stored time as an aware UTC datetime: SQLite gives back naive ones (written as UTC)."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(10)}"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=True)}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    # Weight of this tenant's work in the planner's weighted-completion objective.
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    max_concurrent_trials: Mapped[int] = mapped_column(Integer)
    max_trials_per_task: Mapped[int] = mapped_column(Integer)
    max_file_bytes: Mapped[int] = mapped_column(BigInteger)
    # Storage quota over the tenant's live (not deleted) files. The defaults also serve rows made outside
    # the admin API (the scheduler's tests, benchmarks).
    max_storage_bytes: Mapped[int] = mapped_column(
        BigInteger, default=lambda: get_settings().default_max_storage_bytes)
    max_files: Mapped[int] = mapped_column(Integer, default=lambda: get_settings().default_max_files)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Set by an operator's DELETE (api/services/tenants.py): its keys revoked, its tasks cancelled, its webhooks
    # gone; the row stays (usage, tasks and events are kept for billing) and keeps its name.
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    # sha256 of the key: keys are 256-bit random, so a fast hash is enough and lookups stay O(1).
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class File(Base):
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(300))
    purpose: Mapped[str] = mapped_column(String(40), default="fine-tune")
    bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(40))  # "messages" | "prompt_completion" | "preference[_messages]"
    sha256: Mapped[str] = mapped_column(String(64))
    storage_key: Mapped[str] = mapped_column(String(300))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class BaseModelEntry(Base):
    __tablename__ = "base_models"
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    kind: Mapped[str] = mapped_column(String(40))  # "tiny-random-llama" | "hf" | "gguf-package" | "gguf"
    path: Mapped[str | None] = mapped_column(String(500), default=None)
    package: Mapped[str | None] = mapped_column(String(100), default=None)
    gguf_file: Mapped[str | None] = mapped_column(String(200), default=None)
    # "nf4": a worker holds its linear layers in 4 bits (QLoRA: worker/engine/quantize.py); None: as loaded.
    quantization: Mapped[str | None] = mapped_column(String(20), default=None)
    description: Mapped[str] = mapped_column(Text, default="")
    parameters: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # The tenant ids that may use the model; None: every tenant.
    tenants: Mapped[list[Any] | None] = mapped_column(default=None)
    architecture: Mapped[str | None] = mapped_column(String(100), default=None)  # config.json's model_type
    max_context: Mapped[int | None] = mapped_column(Integer, default=None)  # config.json's max_position_embeddings
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime | None] = mapped_column(default=None)
    # Whether the tokenizer has a chat template (chat rows need one); None: not inspected.
    chat_template: Mapped[bool | None] = mapped_column(Boolean, default=None)
    # Set by DELETE /v1/admin/models/{name}: hidden and unusable, kept for the finished tasks that name it.
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class Task(Base):
    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    base_model: Mapped[str] = mapped_column(ForeignKey("base_models.name"))
    training_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"), default=None)
    state: Mapped[str] = mapped_column(String(20), index=True)
    # The whole validated request, so a task can always be shown exactly as submitted; read it as `parsed_spec`.
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)
    best_trial_id: Mapped[str | None] = mapped_column(String(40), default=None)
    # The trial that trains the best trial's configuration again on training + validation rows (`"refit": true`),
    # once the search has ended; None without one.
    refit_trial_id: Mapped[str | None] = mapped_column(String(40), default=None)
    # What the task was predicted to take at submission ({"tokens", "gpu_seconds", "wall_seconds"}) and, once it
    # ended, what it took (`"actual"`, the same keys): api/services/estimates.py.
    estimate: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # Why its pending trials wait, as the scheduler's last plan saw it ({"reason", "message", "position",
    # "estimated_start_at", ...}); None while none waits: scheduler/service/waits.py.
    # None is SQL NULL (not JSON null), so that `waiting IS NOT NULL` selects only the tasks that wait.
    waiting: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_tasks_idempotency"),
        # The tasks lists, newest first (api/db.py newest_first): a tenant's, and every tenant's for the operator.
        Index("ix_tasks_tenant_id_created_at_id", "tenant_id", "created_at", "id"),
        Index("ix_tasks_created_at_id", "created_at", "id"),
        # The tasks that say why they wait (a few among every task ever stored): the cluster view's `waiting`.
        Index("ix_tasks_waiting", "created_at", "id", postgresql_where=text("waiting IS NOT NULL"),
              sqlite_where=text("waiting IS NOT NULL")),
    )

    @property
    def parsed_spec(self) -> TaskSpec:
        """The stored spec, typed, with the defaults of fields an older row lacks (common/task_spec.py); the model
        and files are the row's own columns. Parsed once per loaded row and kept beside it (the scheduler reads it
        for every pending trial of every round), again only if `spec` is given a new value."""
        stored = self.spec
        cached = self.__dict__.get("_parsed_spec")
        if cached is None or cached[0] is not stored:
            parsed = TaskSpec.from_stored({**stored, "base_model": self.base_model,
                                           "training_file": self.training_file_id,
                                           "validation_file": self.validation_file_id})
            cached = self.__dict__["_parsed_spec"] = (stored, parsed)
        return cached[1]


class Trial(Base):
    __tablename__ = "trials"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(20), index=True)
    # A refit (its task's `"refit": true`): the trial whose configuration it trains again on the training and
    # validation rows. It is not one of the search's trials: never ranked, never early-exited, never validated.
    refit_of: Mapped[str | None] = mapped_column(String(40), default=None)
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(JSON)
    total_steps: Mapped[int] = mapped_column(Integer)
    steps_done: Mapped[int] = mapped_column(Integer, default=0)
    pack_id: Mapped[str | None] = mapped_column(String(40), default=None, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    best_val_loss: Mapped[float | None] = mapped_column(Float, default=None)
    best_step: Mapped[int | None] = mapped_column(Integer, default=None)
    # Its validation curve's score when its task's trials are ranked (common.metrics.selection_loss: the smoothed
    # curve's lowest point), kept with its points; None without validation points.
    selection_loss: Mapped[float | None] = mapped_column(Float, default=None)
    last_train_loss: Mapped[float | None] = mapped_column(Float, default=None)
    # The score on the task's generative metric (common/metrics.py) of its best adapter, from the worker's newest
    # "metric" point; None for the loss metric, and until the trial has ended.
    metric_score: Mapped[float | None] = mapped_column(Float, default=None)
    stop_reason: Mapped[str | None] = mapped_column(Text, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    adapter_key: Mapped[str | None] = mapped_column(String(300), default=None)
    # The newest checkpoint in the artifact store: a requeued trial resumes from it instead of step 0.
    checkpoint_key: Mapped[str | None] = mapped_column(String(300), default=None)
    checkpoint_step: Mapped[int | None] = mapped_column(Integer, default=None)
    # Back-filled into a running pack and not yet confirmed by its worker (trial.admitted): if the pack ends
    # first, the trial goes back to pending instead of failing.
    awaiting_admission: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Times its worker was lost under it (a loss spends no attempt; scheduler/planning/faults.py), and when it may
    # be placed again after the latest (the requeue backoff; None: at once).
    worker_losses: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Preemption (scheduler/service/fairness.py): times this trial's pack was paused for another tenant, and while
    # it is held back for that tenant's waiting trials (until they start or its slice passes), that tenant's id.
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    preempted_for: Mapped[str | None] = mapped_column(String(40), default=None)
    not_before: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class MetricPoint(Base):
    __tablename__ = "metric_points"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    trial_id: Mapped[str] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    split: Mapped[str] = mapped_column(String(10))  # "train" | "val" | "metric"
    loss: Mapped[float] = mapped_column(Float)  # "metric": the score in [0, 1], the share of rows that passed
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # A point replayed from the bus after a scheduler crash must not be stored twice.
    __table_args__ = (UniqueConstraint("trial_id", "step", "split", name="uq_metric_points_trial_step_split"),)


class Checkpoint(Base):
    """A trial's adapter at one step, kept for download and sampling (common/checkpoints.py says which are kept); its
    worker's `trial.checkpoint_saved` report adds it and drops the ones no longer kept. Its bytes count in its
    tenant's stored bytes."""

    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    trial_id: Mapped[str] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[float] = mapped_column(Float)
    epoch_end: Mapped[bool] = mapped_column(Boolean)
    val_loss: Mapped[float | None] = mapped_column(Float, default=None)
    adapter_key: Mapped[str] = mapped_column(String(300))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("trial_id", "step", name="uq_checkpoints_trial_step"),)


class Event(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    trial_id: Mapped[str | None] = mapped_column(String(40), default=None)
    type: Mapped[str] = mapped_column(String(60))
    level: Mapped[str] = mapped_column(String(10), default="info")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_events_task_id_id", "task_id", "id"),)


class Worker(Base):
    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    queue: Mapped[str] = mapped_column(String(300))
    device: Mapped[str] = mapped_column(String(200))
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)  # of ONE of its GPUs
    # The GPUs of one host it runs each pack over (`loraplane worker --gpus 0,1`), from its heartbeat; the planner
    # gives a pack on it all of their memory. 1 for a worker whose heartbeat does not say (older workers).
    gpus: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    max_slots: Mapped[int] = mapped_column(Integer, default=DEFAULT_MAX_TRIALS_PER_PACK)
    # How many packs it runs at once (LORAPLANE_WORKER_MAX_PACKS; 1 for a worker whose heartbeat does not say), and
    # its memory less what its running packs reserved (None: not said): worker/colocation.py.
    max_packs: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    free_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # The device memory its sampler process holds (worker/sampler.py), from its heartbeat: the planner gives packs
    # its memory less this (None: not said, taken as none).
    sampler_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    state: Mapped[str] = mapped_column(String(20))  # "alive" | "lost"
    current_pack_id: Mapped[str | None] = mapped_column(String(40), default=None)  # the newest it started
    # The worker process now behind this id (new on every start) and when it started: a heartbeat from a
    # newer one ends the older one's packs at once; one from an older one is a stale message.
    incarnation: Mapped[str | None] = mapped_column(String(64), default=None)
    incarnation_started_at: Mapped[datetime | None] = mapped_column(default=None)
    # The registered models this worker can load (its heartbeat says); None: it does not say, taken as every one.
    models: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    # The base models it holds loaded, most recently used first (its heartbeat says: name, revision, bytes,
    # last_used_at): the planners prefer, all else equal, the worker that has a pack's model warm. None: not said.
    warm_models: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    # The time the newest heartbeat carried (when it was sent, not when it was read).
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Packs it lost (epoch seconds, those within the quarantine window of the latest), its quarantines in a row
    # since a pack last ended well on it, and until when the planners give it no pack (scheduler/planning/faults.py).
    lost_packs: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    quarantines: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    quarantined_until: Mapped[datetime | None] = mapped_column(default=None)


class Pack(Base):
    __tablename__ = "packs"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    worker_id: Mapped[str] = mapped_column(String(200), index=True)
    base_model: Mapped[str] = mapped_column(String(100))
    # planned -> dispatched -> running -> finished | lost | cancelled; dispatched -> refused (its worker had no room)
    state: Mapped[str] = mapped_column(String(20))
    trial_ids: Mapped[list[Any]] = mapped_column(JSON)  # every trial placed in it, back-fills included
    # The engine's shape, fixed at the start: back-fills must fit it (None: a pack that takes no back-fills).
    capacity: Mapped[int | None] = mapped_column(Integer, default=None)
    max_rank: Mapped[int | None] = mapped_column(Integer, default=None)
    target_modules: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    # The GPUs it runs over: its worker's when it was planned (`loraplane worker --gpus`). It holds all of them from
    # its start to its end, so its GPU time is its wall time times these (common/usage.py).
    gpus: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # The planner's predicted peak bytes (its base model and members, cost model): what its worker reserves for it
    # beside its other packs (worker/colocation.py); None: planned before this column.
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # The worker process that started it (its `pack.started`): reports from any other are dropped.
    incarnation: Mapped[str | None] = mapped_column(String(64), default=None)
    # The worker's newest `pack.progress` (mean step seconds, tokens, slots of its last stretch of steps):
    # corrects the planner's step-time predictions while the pack runs.
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # Measured by the worker (step time and peak memory against batch tokens) for the planner's cost model.
    profile: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    # Indexed: the packs inside a usage window are the live ones (NULL) and those that finished after its start.
    finished_at: Mapped[datetime | None] = mapped_column(default=None, index=True)
    # Live packs, and a state's packs newest first (GET /v1/admin/packs).
    __table_args__ = (Index("ix_packs_state_created_at_id", "state", "created_at", "id"),)


class SamplingUsage(Base):
    """One sampling request answered (issue 35: completions from a trial, a checkpoint or a base model): its tokens,
    counted in its tenant's usage (common/usage.py). Written by the API once the answer is whole."""

    __tablename__ = "sampling_usage"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(200))  # what answered, as the response's `model` names it
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class TrialUsage(Base):
    """What one trial trained in one pack, from its worker's `trial.finished` report (completed, stopped, paused or
    failed there): the pack's GPU time is shared among its trials by these tokens (common/usage.py)."""

    __tablename__ = "trial_usage"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    pack_id: Mapped[str] = mapped_column(String(40), index=True)
    trial_id: Mapped[str] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    tokens: Mapped[int] = mapped_column(BigInteger)  # real (non-padding) training tokens
    steps: Mapped[int] = mapped_column(Integer)  # optimizer steps taken in the pack
    end_step: Mapped[int] = mapped_column(Integer)  # the trial's step when it left the pack
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # A report replayed from the bus after a scheduler crash is not counted twice; a trial paused and resumed into
    # the same pack leaves it twice, at two different steps.
    __table_args__ = (UniqueConstraint("pack_id", "trial_id", "end_step", name="uq_trial_usage_pack_trial_step"),)


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[list[Any]] = mapped_column(JSON)  # the event types it receives (common/webhooks.py)
    description: Mapped[str] = mapped_column(String(500), default="")
    # The signing secret, encrypted under LORAPLANE_SECRET_KEY (common/secret_box.py): not hashed, since the
    # sender signs every delivery with it (HMAC needs the secret itself, unlike an API key, which is only ever
    # compared); not plaintext, so a copy of the database cannot forge a tenant's deliveries.
    secret_encrypted: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Tracker(Base):
    """An experiment tracker a task logs its trials to (its `integrations`; scheduler/service/trackers.py syncs
    them): each trial a run with its hyperparameters, curves, end and adapter."""

    __tablename__ = "trackers"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    type: Mapped[str] = mapped_column(String(20))  # "mlflow" | "wandb"
    tracking_uri: Mapped[str] = mapped_column(String(2000))  # W&B's: its own service (the tenant names none)
    experiment: Mapped[str] = mapped_column(String(250))  # W&B's project
    entity: Mapped[str | None] = mapped_column(String(250), default=None)  # W&B's
    mode: Mapped[str | None] = mapped_column(String(20), default=None)  # W&B's: "online" | "offline"
    # The tracker's token (MLflow's bearer token, W&B's API key), encrypted like a webhook's secret; None: none.
    token_encrypted: Mapped[str | None] = mapped_column(String(2000), default=None)
    # Every trial's run finished there (its task ended): nothing left to sync.
    done_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TrackerRun(Base):
    """One trial's run in one tracker and how far it is synced: the outbox's cursor. The trial's points, state and
    adapter are the committed record; this says what of it the tracker has acknowledged, so an outage only delays
    what it has not."""

    __tablename__ = "tracker_runs"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tracker_id: Mapped[str] = mapped_column(ForeignKey("trackers.id", ondelete="CASCADE"))
    trial_id: Mapped[str] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    run_id: Mapped[str | None] = mapped_column(String(100), default=None)  # the tracker's
    artifact_uri: Mapped[str | None] = mapped_column(String(2000), default=None)
    params_synced: Mapped[bool] = mapped_column(Boolean, default=False)
    point_cursor: Mapped[int] = mapped_column(BigInteger, default=0)  # the last metric point (its id) logged
    finished: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # failed in a row
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("tracker_id", "trial_id", name="uq_tracker_runs_tracker_trial"),)


class WebhookDelivery(Base):
    """The outbox: one row per (event, endpoint), written in the event's own transaction (common/events.py), so
    an event that happened always has its deliveries. Marked delivered only after a 2xx answer."""

    __tablename__ = "webhook_deliveries"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    event_id: Mapped[int] = mapped_column(BigInteger)
    event_type: Mapped[str] = mapped_column(String(60))
    # The body as sent, built when the event happened: a retry sends the same bytes' content as the first try.
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(20))  # "pending" | "delivered" | "failed"
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # When the sender may take it next: due now, the next retry, or the end of a claim (a sender that died while
    # sending leaves it claimed until then, and another round sends it again).
    next_attempt_at: Mapped[datetime | None] = mapped_column(default=utcnow)
    last_attempt_at: Mapped[datetime | None] = mapped_column(default=None)
    last_status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_webhook_deliveries_due", "state", "next_attempt_at"),)


class FileTokenLengths(Base):
    """A file's row lengths under one model's tokenizer (common/token_lengths.py `FileLengths`), counted once, at the
    first task that submits the file with that model, and kept for the next ones. `tokenizer` is the tokenizer's
    fingerprint (common/model_tokenizers.py): lengths counted with another tokenizer are counted again."""

    __tablename__ = "file_token_lengths"
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(100), primary_key=True)
    tokenizer: Mapped[str] = mapped_column(String(64), primary_key=True)
    lengths: Mapped[dict[str, Any]] = mapped_column(JSON)  # FileLengths.to_stored()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditEntry(Base):
    """One read of a tenant's data by the operator (the admin token): who, when, what route, which tenant and
    object (api/services/audit.py). Written by the API only; kept when the tenant is deleted (no foreign key):
    the record of who looked at a tenant's data outlives the tenant."""

    __tablename__ = "audit_log"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    actor: Mapped[str] = mapped_column(String(64))  # "admin:<first 12 hex of the token's SHA-256>"
    method: Mapped[str] = mapped_column(String(10))
    route: Mapped[str] = mapped_column(String(200))  # the route's template, "/v1/tasks/{task_id}"
    tenant_id: Mapped[str | None] = mapped_column(String(40), default=None, index=True)  # None: a list of all
    resource_id: Mapped[str | None] = mapped_column(String(40), default=None)  # the trial's, else the task's id
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_audit_log_created_at_id", "created_at", "id"),)
