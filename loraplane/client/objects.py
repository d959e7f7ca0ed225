"""Typed views of the API's objects. Each keeps the exact object it was read from in `raw` (what
`--json` prints); fields the client does not know yet stay in `raw`, and a field the server left out
reads as None. Timestamps become aware `datetime`s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T")
ObjT = TypeVar("ObjT", bound="ApiObject")

TASK_FINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
TRIAL_FINAL_STATES = frozenset({"completed", "stopped_early", "failed", "cancelled"})


def parse_time(value: Any) -> datetime | None:
    """The API's ISO-8601 UTC strings ('...Z') as aware datetimes."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


@dataclass(frozen=True)
class ApiObject:
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    TIMES: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def of(cls: type[ObjT], raw: dict[str, Any]) -> ObjT:
        values = {f.name: raw.get(f.name) for f in fields(cls) if f.name != "raw" and f.init}
        for name in cls.TIMES:
            values[name] = parse_time(values.get(name))
        return cls(**values, raw=raw)


@dataclass(frozen=True)
class File(ApiObject):
    id: str
    filename: str
    purpose: str
    bytes: int
    rows: int
    format: str
    sha256: str
    created_at: datetime

    TIMES = frozenset({"created_at"})


@dataclass(frozen=True)
class FileDeleted(ApiObject):
    id: str
    deleted: bool


@dataclass(frozen=True)
class CheckpointDeleted(ApiObject):
    trial_id: str
    step: int
    deleted: bool


@dataclass(frozen=True)
class Webhook(ApiObject):
    """An endpoint the service POSTs the tenant's task outcomes to; `secret` only in the answer that created it."""

    id: str
    url: str
    events: list[str]
    description: str
    created_at: datetime
    secret: str | None = None

    TIMES = frozenset({"created_at"})


@dataclass(frozen=True)
class WebhookDeleted(ApiObject):
    id: str
    deleted: bool


@dataclass(frozen=True)
class WebhookDelivery(ApiObject):
    """One event's delivery to one endpoint: pending (retried with backoff), delivered or failed."""

    id: str
    webhook_id: str
    event_id: int
    event_type: str
    state: str
    attempts: int
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: datetime | None
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    created_at: datetime

    TIMES = frozenset({"last_attempt_at", "next_attempt_at", "delivered_at", "created_at"})


@dataclass(frozen=True)
class Usage(ApiObject):
    """A tenant's usage in a window (`GET /v1/usage`): GPU seconds shared among trials by tokens, tokens trained,
    trials of the tasks that ended in it by final state, and uploaded bytes now."""

    tenant_id: str
    start: datetime | None
    end: datetime
    gpu_seconds: float
    tokens: int
    trials: dict[str, int]
    storage_bytes: int  # uploaded files and kept checkpoints, what the storage quota bounds
    checkpoint_bytes: int | None = None  # of which the kept checkpoints (None: a server that does not say)
    sampling_tokens: int | None = None  # of its sampling requests answered in the window

    TIMES = frozenset({"start", "end"})


@dataclass(frozen=True)
class Model(ApiObject):
    id: str
    kind: str
    description: str
    parameters: int | None
    architecture: str | None = None
    max_context: int | None = None
    target_modules: list[str] | None = None
    chat_template: bool | None = None
    quantization: str | None = None  # "nf4": a base held in 4 bits (QLoRA)


@dataclass(frozen=True)
class RegisteredModel(ApiObject):
    """A registry entry as the operator sees it (`admin.list_models`): where it lives and who may use it."""

    name: str
    kind: str
    path: str | None
    description: str
    architecture: str | None
    max_context: int | None
    target_modules: list[str] | None
    tenants: list[str] | None
    created_at: datetime
    chat_template: bool | None = None
    deleted_at: datetime | None = None
    quantization: str | None = None

    TIMES = frozenset({"created_at", "deleted_at"})


@dataclass(frozen=True)
class TrialCounts(ApiObject):
    pending: int = 0
    running: int = 0
    waiting: int = 0
    completed: int = 0
    stopped_early: int = 0
    failed: int = 0
    cancelled: int = 0

    @classmethod
    def of(cls, raw: dict[str, Any]) -> TrialCounts:
        return cls(**{f.name: int(raw.get(f.name) or 0) for f in fields(cls) if f.name != "raw"}, raw=raw)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "raw")


@dataclass(frozen=True)
class BestTrial(ApiObject):
    id: str
    hyperparameters: dict[str, Any]
    best_val_loss: float | None
    best_step: int | None
    metric_score: float | None = None  # its score on the task's generative metric (None for the loss metric)


@dataclass(frozen=True)
class TaskWaiting(ApiObject):
    """Why a task's pending trials wait (`Task.waiting`): `reason` is one of no_worker, model_not_loadable,
    does_not_fit, behind_pack, planned_later, retry_backoff; `message` says it in words."""

    reason: str
    message: str
    position: int | None  # 1 = next among the waiting tasks; None while its trials wait out a retry backoff
    estimated_start_at: datetime | None  # when its first waiting trial is predicted to start
    waiting_trials: int
    updated_at: datetime
    pack_id: str | None = None  # behind_pack: the pack it waits behind, and its worker
    worker_id: str | None = None

    TIMES = frozenset({"estimated_start_at", "updated_at"})


@dataclass(frozen=True)
class Cost(ApiObject):
    """Tokens trained, GPU seconds held and wall seconds: predicted (`TaskEstimate`) or taken (`.actual`)."""

    tokens: int
    gpu_seconds: float
    wall_seconds: float | None  # None in an estimate when no live worker that can load the model could take the trials


@dataclass(frozen=True)
class EstimateBasis(ApiObject):
    """What an estimate rests on: `source` "prior" (the device kind's priors) or "fitted" (from `packs` packs of the
    model on `device_kind`)."""

    source: str
    device_kind: str
    packs: int


@dataclass(frozen=True)
class TaskEstimate(Cost):
    """What a task was predicted to cost at submission (`Task.estimate`), the range its wall time is expected in,
    what the prediction rests on, and `actual` once the task ended. None of a field an older server does not send."""

    wall_seconds_low: float | None = None
    wall_seconds_high: float | None = None
    basis: EstimateBasis | None = None
    actual: Cost | None = None

    @classmethod
    def of(cls, raw: dict[str, Any]) -> TaskEstimate:
        basis, actual = raw.get("basis"), raw.get("actual")
        return replace(super().of(raw), basis=EstimateBasis.of(basis) if isinstance(basis, dict) else None,
                       actual=Cost.of(actual) if isinstance(actual, dict) else None)


@dataclass(frozen=True)
class Task(ApiObject):
    id: str
    state: str
    base_model: str
    training_file: str
    validation_file: str | None
    validation_split: float | None
    strategy: str
    search_space: dict[str, Any]
    max_trials: int | None
    epochs: int | None
    max_steps: int | None
    max_seq_len: int
    eval_interval: int
    early_exit: dict[str, Any]
    seed: int
    training: dict[str, Any]
    scheduling: dict[str, Any]
    trial_counts: TrialCounts
    progress: float
    best_trial: BestTrial | None
    estimated_seconds_left: float | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # {"metric", "max_new_tokens", "pattern"}: how the best trial is chosen (None: a server that does not say, loss).
    evaluation: dict[str, Any] | None = None
    # {"type": "sft"} or {"type": "dpo", "loss", "label_smoothing"} (None: an older server, SFT).
    objective: dict[str, Any] | None = None
    # Why its pending trials wait, its place in the queue and predicted start (None: none waits, or an older server).
    waiting: TaskWaiting | None = None
    # Predicted tokens, GPU seconds and wall seconds at submission, `actual` once it ended (None: before estimates).
    estimate: TaskEstimate | None = None
    suffix: str | None = None  # the submitter's label and string pairs (OpenAI's names), kept as given
    metadata: dict[str, str] | None = None
    # Whether the best configuration is trained again on training + validation rows once the search ends, and that
    # refit's trial once it exists (its adapter: `download_adapter(..., refit=True)`).
    refit: bool = False
    refit_trial_id: str | None = None

    TIMES = frozenset({"created_at", "started_at", "finished_at"})

    @classmethod
    def of(cls, raw: dict[str, Any]) -> Task:
        best, waiting, estimate = raw.get("best_trial"), raw.get("waiting"), raw.get("estimate")
        return replace(super().of(raw), trial_counts=TrialCounts.of(raw.get("trial_counts") or {}),
                       best_trial=BestTrial.of(best) if isinstance(best, dict) else None,
                       waiting=TaskWaiting.of(waiting) if isinstance(waiting, dict) else None,
                       estimate=TaskEstimate.of(estimate) if isinstance(estimate, dict) else None)

    @property
    def done(self) -> bool:
        """succeeded, failed or cancelled: nothing will change any more."""
        return self.state in TASK_FINAL_STATES

    @property
    def metric(self) -> str:
        """The metric the trials are judged by: "loss", or a scored one — generative (exact_match, contains, regex,
        json_valid) or a DPO task's reward_accuracy — whose score is each trial's `metric_score`."""
        return str((self.evaluation or {}).get("metric") or "loss")

    @property
    def scored(self) -> bool:
        """Judged by a score (`metric_score`, the highest best) rather than by the validation loss."""
        return self.metric != "loss"

    @property
    def dpo(self) -> bool:
        """Trained by DPO on preference rows (its trials' hyperparameters have a beta)."""
        return (self.objective or {}).get("type") == "dpo"


@dataclass(frozen=True)
class Trial(ApiObject):
    id: str
    task_id: str
    index: int
    state: str
    hyperparameters: dict[str, Any]
    total_steps: int
    steps_done: int
    best_val_loss: float | None
    best_step: int | None
    last_train_loss: float | None
    stop_reason: str | None
    error: str | None
    attempts: int
    checkpoint_step: int | None
    adapter_ready: bool | None  # whether its adapter can be downloaded now (None: a server that does not say)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # The share of validation rows its best adapter answered right by the task's generative metric (None: the loss
    # metric, or not scored yet).
    metric_score: float | None = None
    refit_of: str | None = None  # a refit's: the trial whose configuration it trains again (None: a search trial)

    TIMES = frozenset({"created_at", "started_at", "finished_at"})

    @property
    def done(self) -> bool:
        return self.state in TRIAL_FINAL_STATES


@dataclass(frozen=True)
class Checkpoint(ApiObject):
    """A trial's adapter kept at one step (`GET .../trials/{id}/checkpoints`): `kinds` says whether it is the best,
    the last and an epoch's end; `model` names it in chat completions."""

    task_id: str
    trial_id: str
    step: int
    epoch: float
    kinds: list[str]
    val_loss: float | None
    metric_score: float | None
    size_bytes: int
    model: str
    created_at: datetime

    TIMES = frozenset({"created_at"})


@dataclass(frozen=True)
class LossPoint:
    step: int
    loss: float


@dataclass(frozen=True)
class MetricScore:
    step: int
    score: float


@dataclass(frozen=True)
class TrialMetrics(ApiObject):
    trial_id: str
    train: list[LossPoint]
    val: list[LossPoint]
    metric: list[MetricScore] = field(default_factory=list)  # scores on the task's generative metric

    @classmethod
    def of(cls, raw: dict[str, Any]) -> TrialMetrics:
        def points(key: str) -> list[LossPoint]:
            return [LossPoint(step=int(p["step"]), loss=float(p["loss"])) for p in raw.get(key) or []]

        scores = [MetricScore(step=int(p["step"]), score=float(p["score"])) for p in raw.get("metric") or []]
        return cls(trial_id=str(raw.get("trial_id")), train=points("train"), val=points("val"), metric=scores,
                   raw=raw)


@dataclass(frozen=True)
class Completion(ApiObject):
    """An answer sampled from a trial's adapter (`tasks.complete`): its text, why it ended (`stop`, `length`), the
    trial that answered, and its tokens."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    trial_id: str | None
    prompt_tokens: int
    completion_tokens: int
    load_s: float

    @classmethod
    def of(cls, raw: dict[str, Any]) -> Completion:
        choice = raw["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        extension, usage = raw.get("loraplane") or {}, raw.get("usage") or {}
        return cls(id=raw["id"], model=raw["model"], text=text, finish_reason=choice.get("finish_reason"),
                   trial_id=extension.get("trial_id"), prompt_tokens=int(usage.get("prompt_tokens", 0)),
                   completion_tokens=int(usage.get("completion_tokens", 0)),
                   load_s=float(extension.get("load_s", 0.0)), raw=raw)


@dataclass(frozen=True)
class Event(ApiObject):
    id: int
    created_at: datetime
    type: str
    level: str
    message: str
    trial_id: str | None
    data: dict[str, Any]

    TIMES = frozenset({"created_at"})


@dataclass(frozen=True)
class Tenant(ApiObject):
    id: str
    name: str
    weight: float
    max_concurrent_trials: int
    max_trials_per_task: int
    max_file_bytes: int
    max_storage_bytes: int
    max_files: int
    created_at: datetime
    deleted_at: datetime | None = None  # set once an operator deleted the tenant

    TIMES = frozenset({"created_at", "deleted_at"})


@dataclass(frozen=True)
class ApiKey(ApiObject):
    id: str
    tenant_id: str
    prefix: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
    key: str | None = field(default=None, repr=False)  # the secret: only in the answer that created the key

    TIMES = frozenset({"created_at", "revoked_at"})


@dataclass(frozen=True)
class Worker(ApiObject):
    id: str
    queue: str
    device: str
    memory_bytes: int | None
    max_slots: int
    state: str
    current_pack_id: str | None
    last_heartbeat: datetime
    registered_at: datetime
    models: list[str] | None = None  # the registered models it can load; None: it does not say (every one)
    gpus: int = 1  # GPUs of one host it owns (memory_bytes is one GPU's): each pack runs over all of them
    # It lost packs repeatedly: the scheduler gives it none until then (None: not quarantined).
    quarantined_until: datetime | None = None
    recent_lost_packs: int = 0  # packs it lost within the quarantine window
    # The base models it holds loaded, most recently used first: {"name", "revision", "bytes", "last_used_at"}
    # (an ISO time); None: it does not say.
    warm_models: list[dict[str, Any]] | None = None

    TIMES = frozenset({"last_heartbeat", "registered_at", "quarantined_until"})


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list: `data`, `has_more`; iterate it for the items. Pass `next_after` as `after` for the
    next page (the last item's id; for events the API's own `next_after`)."""

    data: list[T]
    has_more: bool
    next_after: Any = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __iter__(self) -> Iterator[T]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> T:
        return self.data[index]


def page(raw: dict[str, Any], item: type[ObjT]) -> Page[ObjT]:
    data = [item.of(x) for x in raw.get("data") or []]
    last = data[-1].raw.get("id") if data else None
    return Page(data=data, has_more=bool(raw.get("has_more")), next_after=raw.get("next_after", last), raw=raw)
