"""Every message that crosses between the scheduler and its workers, typed: both ends build and read them here.

Three channels carry them:
- the pack a worker runs (`PackMessage`, a `TrialPayload` per trial): the argument of the Celery task
  `RUN_PACK_TASK` on the worker's queue. scheduler/service/dispatch.py builds it, worker/celery_app.py parses it;
- commands on a worker's stream, `commands:{worker_id}` (`AdmitTrials`, `StopTrials`, `AbortPack`): the scheduler
  daemon sends them, the worker's `CommandInbox` (worker/bus_client.py) reads them;
- sampling (issue 35, worker/sampler.py): a `SampleRequest` on its base model's stream, `sampling:{model}`, from the
  API to whichever worker's sampler takes it; the answer as `SampleReply` messages on the request's own stream,
  `sampling-reply:{request_id}`, which the API reads and then discards;
- reports on the scheduler stream: a worker's `WorkerHeartbeat`, its packs' reports (`PackStarted`, `Points`,
  `TrialCheckpoint`, ..., `PackFinished`) and the API's `Wake`. scheduler/service/ingest.py applies them.

On the wire each is the JSON object of its fields (`to_dict`), with `type` (which message) and `version` (of its
format). A message without `version` is of version 1: it was sent before the field existed.

Reading one never raises: `parse_pack`, `parse_command` and `parse_report` log a message they cannot read, tell
``on_drop`` why (each side counts it: `loraplane_scheduler_bus_messages_dropped_total`, and the worker's) and
return None; the caller goes on to the next one (a stream's reader acks it all the same: read again it would fail
again).

How the format may change: a field added with a default needs no new version (a reader leaves out the fields it
does not know, and a message from an older sender takes the default); a field renamed, retyped or removed does,
and readers then accept both versions until no sender of the old one is left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from common.settings import DEFAULT_MAX_TRIALS_PER_PACK

log = logging.getLogger(__name__)

VERSION = 1  # the format this code sends
READABLE_VERSIONS = frozenset({1})  # the formats it reads

# Why a message was dropped (the `reason` label of the dropped-messages counter).
UNKNOWN_TYPE = "unknown_type"
UNKNOWN_VERSION = "unknown_version"
MALFORMED = "malformed"

OnDrop = Callable[[str], None]  # told the reason of each message dropped


class Message(BaseModel):
    """A message's fields. Built with a field it does not have, it raises (a sender's typo fails at once); read
    with one, it leaves it out (a newer sender's addition)."""

    model_config = ConfigDict(extra="forbid")
    # Fields a sender leaves out of the wire when None: their absence means "not said", which the reader tells
    # from a value.
    omit_when_none: ClassVar[frozenset[str]] = frozenset()

    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        """The JSON object sent on the wire."""
        return {k: v for k, v in self.model_dump().items() if v is not None or k not in self.omit_when_none}


# The pack a worker runs (the Celery task's argument).


class TrialPayload(BaseModel):
    """What a worker needs to train one trial: in a `PackMessage`, and in an `AdmitTrials` command. The task's
    structures (`hyperparameters`, `training`, `evaluation`) are checked by the worker as it builds the trial's spec,
    so that a trial that cannot be built fails alone (worker/pack_runner.py)."""

    model_config = ConfigDict(extra="forbid")

    trial_id: str
    task_id: str
    hyperparameters: dict[str, Any]
    total_steps: int
    max_seq_len: int
    eval_interval: int
    training_file_key: str
    validation_file_key: str | None = None
    validation_split: float | None = None
    split_seed: int  # the split depends on the task only, so every trial validates on the same rows
    training: dict[str, Any] = {}
    # How the trial is judged (common/metrics.py): a generative metric has the worker decode the validation rows
    # with the trial's best adapter when it ends and report the score as a "metric" point. None: loss.
    evaluation: dict[str, Any] | None = None
    # What it minimises (common/task_spec.py `Objective.as_dict`): None, SFT; {"type": "dpo", "loss",
    # "label_smoothing"} with its beta in `hyperparameters`.
    objective: dict[str, Any] | None = None
    # A requeued trial resumes from its newest checkpoint instead of step 0.
    resume_key: str | None = None
    resume_step: int | None = None
    extra_eval_steps: list[int] = []  # where the task's early-exit policy must see a validation
    # A refit (its task's `"refit": true`): it trains on the training and validation rows together and validates on
    # none; its adapter is its last step's.
    refit: bool = False
    placed_at: str | None = None  # tells one placement from the next (a trial paused and placed again)


class ModelSourceFields(BaseModel):
    """How a worker loads the pack's base model (common/registry.py, `model_source_fields`)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    quantization: str | None = None  # "nf4": its linear layers held in 4 bits (worker/engine/quantize.py)


class PackMessage(Message):
    omit_when_none: ClassVar[frozenset[str]] = frozenset({"memory_bytes"})

    type: Literal["run_pack"] = "run_pack"
    pack_id: str
    worker_id: str
    base_model: ModelSourceFields
    trials: list[TrialPayload]
    capacity: int | None = None  # the pack's slots (None: it takes no back-fill)
    max_rank: int | None = None
    target_modules: list[str] | None = None
    # The planner's predicted peak bytes of the pack (its base model and members): what the worker reserves for it
    # beside the other packs it runs, and refuses the pack by when they would not fit (None: not said, reserved as 0).
    memory_bytes: int | None = None


class ExportRequest(Message):
    """Build a trial's export and store it at its key (`common.artifacts.export_key`; the Celery task's argument, sent
    by the API on the first `GET .../adapter?format=merged` or `format=gguf`; worker/exports.py): "merged", its base
    with its adapter merged in; "gguf", its adapter as a llama.cpp LoRA GGUF."""

    type: Literal["build_export"] = "build_export"
    task_id: str
    trial_id: str
    adapter_key: str
    base_model: ModelSourceFields
    format: Literal["merged", "gguf"] = "merged"
    # Which send of the build this is (common/export_builds.py): the worker records it in its claim, so the API tells
    # the claim of its latest send from one of a send it gave up on. None: from an API before this field.
    request_id: str | None = None


# Sampling: a request on its base model's stream, the answer in pieces on the request's own (common/bus.py names them).


class SampleRequest(Message):
    """Sample an answer from a trial's adapter (or, with no ``adapter_key``, from the base model): the prompt as chat
    ``messages`` or as a ``prompt``, as the API checked them. A sampler takes it only before ``deadline`` (Unix time):
    after it the API has stopped waiting."""

    type: Literal["sample"] = "sample"
    request_id: str
    tenant_id: str
    task_id: str | None = None
    trial_id: str | None = None
    adapter_key: str | None = None
    base_model: ModelSourceFields
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str] = []
    stream: bool = False
    sent_at: float  # Unix time, when the API sent it
    deadline: float


class SampleReply(Message):
    """A piece of an answer: ``text`` added since the last piece; the last piece (``done``) says why it ended and
    what it cost, or ``error_code`` / ``error_message`` (a request the sampler refused or failed: ``status`` is the
    HTTP status the API answers with)."""

    type: Literal["sample_reply"] = "sample_reply"
    request_id: str
    text: str = ""
    done: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued_s: float = 0.0  # from the request's arrival on the stream to its batch's start
    load_s: float = 0.0  # loading the base model (and adapters) for its batch; 0 when warm
    batch_requests: int = 1  # the requests decoded together with it, itself included
    error_code: str | None = None
    error_message: str | None = None
    status: int = 200


# Commands, on a worker's stream.


class AdmitTrials(Message):
    """Back-fills for a running pack's free slots."""

    type: Literal["admit_trials"] = "admit_trials"
    pack_id: str
    trials: list[TrialPayload]


class StopTrials(Message):
    type: Literal["stop_trials"] = "stop_trials"
    pack_id: str
    trial_ids: list[str]
    # "drop"; "export" saves the best-validation adapter first; "pause" checkpoints and frees the slot. A mode the
    # worker does not know (from a newer scheduler) drops.
    mode: str = "drop"


class AbortPack(Message):
    """The scheduler no longer counts on this pack (it was declared lost, its trials requeued)."""

    type: Literal["abort_pack"] = "abort_pack"
    pack_id: str


Command = AdmitTrials | StopTrials | AbortPack


# Reports, on the scheduler stream.


class Point(NamedTuple):
    """One loss point; on the wire a list ``[trial_id, step, split, loss]``."""

    trial_id: str
    step: int
    split: str  # "train", "val" or "metric" (a generative metric's score, common/metrics.py)
    loss: float


class WorkerHeartbeat(Message):
    """A worker process's presence. `gpus`, `models` and `warm_models` are read leniently by ingest (a malformed
    value is logged and taken as not said), as a beat must prove its worker alive whatever else it says."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"gpus", "models", "warm_models", "progress",
                                                          "progressed_at", "packs", "max_packs",
                                                          "free_memory_bytes", "sampler_bytes", "draining"})

    type: Literal["heartbeat"] = "heartbeat"
    worker_id: str
    queue: str
    device: str = "cpu"
    memory_bytes: int | None = None  # one GPU's
    gpus: Any = None  # how many the worker runs each pack over (None: one)
    max_slots: int = DEFAULT_MAX_TRIALS_PER_PACK
    models: Any = None  # the registered models it can load (None: not said, taken as every model)
    warm_models: Any = None  # the base models it holds loaded (worker/model_cache.py)
    pack_id: str | None = None  # the pack this process runs (None: none)
    incarnation: str | None = None
    started_at: float | None = None  # the process's start, by its clock
    sent_at: float | None = None
    # With a pack: its progress count (steps, validations, phases) and when, by the sender's clock, the count was
    # last seen to change; the scheduler ends a pack stalled for LORAPLANE_WORKER_STALL_S (None: not said).
    progress: int | None = None
    progressed_at: float | None = None
    # Every pack the process runs (a worker runs up to `max_packs` at once), each ``{"pack_id", "progress",
    # "progressed_at"}``; `pack_id` and its progress above are the first of them, for a scheduler from before.
    packs: Any = None
    max_packs: Any = None  # how many packs it runs at once (None: one)
    # Its memory less what its running packs reserved (their planned bytes): what another pack may use.
    free_memory_bytes: Any = None
    # The device memory its sampler process holds now (worker/sampler.py; 0 or None: none), which no pack may use.
    sampler_bytes: Any = None
    # True once the worker drains on SIGTERM (worker/drain.py): it hands its trials back and takes no new pack.
    draining: bool | None = None

    @property
    def names_pack(self) -> bool:
        """Whether the beat says which pack its process runs (a beat from before the field cannot be judged)."""
        return "pack_id" in self.model_fields_set or self.packs is not None


class Wake(Message):
    """The API committed something the scheduler should plan for (best effort: it also polls the database)."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"task_id", "tenant_id"})

    type: Literal["wake"] = "wake"
    reason: str
    task_id: str | None = None
    tenant_id: str | None = None


class PackReport(Message):
    """What every report of a pack carries: the pack, and the worker process that runs it."""

    pack_id: str
    worker_id: str
    incarnation: str | None = None
    sent_at: float | None = None  # by the worker's clock


class PackStarted(PackReport):
    type: Literal["pack.started"] = "pack.started"


class Points(PackReport):
    type: Literal["points"] = "points"
    points: list[Point] = []


class TrialCheckpoint(PackReport):
    """A trial's checkpoint is in the store; it repeats the trial's recent points (worker/bus_client.py, `Reporter`)."""

    type: Literal["trial.checkpoint"] = "trial.checkpoint"
    trial_id: str
    step: int
    checkpoint_key: str
    points: list[Point] = []


class CheckpointSaved(PackReport):
    """A trial's adapter checkpoint (its adapter at ``step`` in PEFT format, for users: common/checkpoints.py) is
    in the store at ``adapter_key``; the trial's stored checkpoints at ``dropped_steps`` are no longer kept. Not to be
    confused with `TrialCheckpoint`, the snapshot a trial resumes from."""

    type: Literal["trial.checkpoint_saved"] = "trial.checkpoint_saved"
    trial_id: str
    step: int
    epoch: float
    epoch_end: bool
    val_loss: float | None = None
    adapter_key: str
    size_bytes: int
    dropped_steps: list[int] = []


class TrialCheckpointLost(PackReport):
    """The checkpoint a trial was to resume from is gone: it starts again from step 0."""

    type: Literal["trial.checkpoint_lost"] = "trial.checkpoint_lost"
    trial_id: str
    checkpoint_key: str | None = None


class TrialAdmitted(PackReport):
    type: Literal["trial.admitted"] = "trial.admitted"
    trial_id: str


class TrialRejected(PackReport):
    type: Literal["trial.rejected"] = "trial.rejected"
    trial_id: str
    reason: str | None = None


class TrialFinished(PackReport):
    """A trial's end in its pack, its adapter (if any) already stored; it repeats the trial's recent points."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"drained"})

    type: Literal["trial.finished"] = "trial.finished"
    trial_id: str
    # "completed", "stopped" or "paused"; anything else is the trial's own failure (with `error`).
    status: str
    steps_done: int | None = None
    best_val_loss: float | None = None
    best_step: int | None = None
    final_train_loss: float | None = None
    adapter_key: str | None = None
    error: str | None = None
    pack_steps: int | None = None  # what it trained in this pack (usage accounting)
    pack_tokens: int | None = None
    points: list[Point] = []
    # A trial "paused" because its worker drains on SIGTERM (worker/drain.py), not by the scheduler's request: it is
    # handed back, pending again at once (None: the scheduler asked for the pause).
    drained: bool | None = None


class PackProgress(PackReport):
    """The mean step since the last one (worker/profile.py): the scheduler corrects its step-time predictions."""

    type: Literal["pack.progress"] = "pack.progress"
    steps: int | None = None
    step_s: float
    tokens: float
    slots: float


class PackProfile(PackReport):
    type: Literal["pack.profile"] = "pack.profile"
    profile: dict[str, Any]


class PackFinished(PackReport):
    type: Literal["pack.finished"] = "pack.finished"


class PackFailed(PackReport):
    type: Literal["pack.failed"] = "pack.failed"
    error: str | None = None


class PackRefused(PackReport):
    """The worker would not start the pack (it did not fit beside the packs it runs): nothing of it ran, and its
    trials wait again without an attempt spent."""

    type: Literal["pack.refused"] = "pack.refused"
    reason: str


Report = (WorkerHeartbeat | Wake | PackStarted | Points | TrialCheckpoint | TrialCheckpointLost | TrialAdmitted
          | TrialRejected | TrialFinished | PackProgress | PackProfile | PackFinished | PackFailed | PackRefused)
# Of one trial.
TrialReport = TrialCheckpoint | CheckpointSaved | TrialCheckpointLost | TrialAdmitted | TrialRejected | TrialFinished
WITH_POINTS = (Points, TrialCheckpoint, TrialFinished)  # the reports that carry loss points


def _by_type(*classes: type[Message]) -> dict[str, type[Any]]:
    return {cls.model_fields["type"].default: cls for cls in classes}


PACK_TYPES = _by_type(PackMessage)
EXPORT_TYPES = _by_type(ExportRequest)
SAMPLE_TYPES = _by_type(SampleRequest)
SAMPLE_REPLY_TYPES = _by_type(SampleReply)
COMMAND_TYPES = _by_type(AdmitTrials, StopTrials, AbortPack)
REPORT_TYPES = _by_type(WorkerHeartbeat, Wake, PackStarted, Points, TrialCheckpoint, CheckpointSaved,
                        TrialCheckpointLost, TrialAdmitted, TrialRejected, TrialFinished, PackProgress, PackProfile,
                        PackFinished, PackFailed, PackRefused)

M = TypeVar("M", bound=Message)


def parse_pack(raw: object, *, on_drop: OnDrop) -> PackMessage | None:
    """The pack message a worker was sent (one from before `type` was sent is a pack too)."""
    if isinstance(raw, dict) and "type" not in raw:
        raw = {**raw, "type": "run_pack"}
    return _parse(raw, PACK_TYPES, "pack", on_drop)


def parse_export(raw: object, *, on_drop: OnDrop) -> ExportRequest | None:
    parsed: ExportRequest | None = _parse(raw, EXPORT_TYPES, "export request", on_drop)
    return parsed


def parse_sample_request(raw: object, *, on_drop: OnDrop) -> SampleRequest | None:
    parsed: SampleRequest | None = _parse(raw, SAMPLE_TYPES, "sample request", on_drop)
    return parsed


def parse_sample_reply(raw: object, *, on_drop: OnDrop) -> SampleReply | None:
    parsed: SampleReply | None = _parse(raw, SAMPLE_REPLY_TYPES, "sample reply", on_drop)
    return parsed


def parse_command(raw: object, *, on_drop: OnDrop) -> Command | None:
    parsed: Command | None = _parse(raw, COMMAND_TYPES, "command", on_drop)
    return parsed


def parse_report(raw: object, *, on_drop: OnDrop) -> Report | None:
    parsed: Report | None = _parse(raw, REPORT_TYPES, "report", on_drop)
    return parsed


def _parse(raw: object, classes: Mapping[str, type[M]], what: str, on_drop: OnDrop) -> M | None:
    try:
        return _read(raw, classes)
    except _Unreadable as exc:
        log.warning("dropping a %s: %s", what, exc)
        on_drop(exc.reason)
        return None


class _Unreadable(Exception):
    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


def _read(raw: object, classes: Mapping[str, type[M]]) -> M:
    if not isinstance(raw, dict):
        raise _Unreadable(MALFORMED, f"not a JSON object: {raw!r:.200}")
    kind = raw.get("type")
    cls = classes.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise _Unreadable(UNKNOWN_TYPE, f"of unknown type {kind!r:.100}")
    version = raw.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise _Unreadable(UNKNOWN_VERSION, f"{kind!r} of version {version!r:.100} (this process reads "
                                           f"{sorted(READABLE_VERSIONS)})")
    try:
        # Fields this version does not know are a newer sender's additions: left out, not refused.
        return cls.model_validate({k: v for k, v in raw.items() if k in cls.model_fields})
    except ValidationError as exc:
        raise _Unreadable(MALFORMED, f"{kind!r}, malformed: {_errors(exc)}") from None


def _errors(exc: ValidationError) -> str:
    """The fields at fault and why, without their values (a points batch can be long, and names tenants' trials)."""
    errors = exc.errors(include_input=False, include_url=False)
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'message'}: {e['msg']}" for e in errors[:5])
    return shown + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else "")
