"""Together AI's fine-tunes as tasks, both ways, with no I/O: a fine-tune request becomes a task request
(`task_body`), a task becomes a fine-tune (`fine_tune_of`), its events and its best trial's checkpoints become
Together's (`fine_tune_event`, `fine_tune_checkpoint`), and a task request's error names Together's field
(`together_loc`). The routes (api/routes/together.py) run the task's own services between them.

What maps to what:
- `model` is the base model; `training_method.method` "sft" an SFT task, "dpo" a DPO one (`objective`), its
  `dpo_beta` the search space's beta; `n_epochs` is `epochs`, `random_seed` the seed, `max_seq_length` max_seq_len.
- `learning_rate` (absolute, as Together's), `batch_size` ("max": the service's default) and `training_type`'s
  `lora_r`, `lora_alpha`, `lora_dropout` are search-space dimensions (lora_r is lora_rank); its
  `lora_trainable_modules` ("all-linear" or names separated by commas) is one choice of target_modules. A list
  where Together takes a number makes the fine-tune a search over it (our extension).
- `lr_scheduler` linear|cosine (decaying to zero: min_lr_ratio 0, a cosine's num_cycles 0.5), `warmup_ratio` 0 (no
  warm-up) or 0.03 (our default: 3% of each trial's steps), `max_grad_norm` (0: no clipping) and `weight_decay` go
  to the task's `training`.
- `wandb_key`, `wandb_project_name`, `wandb_entity` are the task's W&B tracker; `suffix` is the task's.
- Accepted with no effect: `n_evals` (a task validates a tenth of the way through each trial), `n_checkpoints` (a
  trial keeps its epoch ends, best and last), `wandb_name` (a run is named by its trial), packing true (rows
  always go end to end), train_on_inputs "auto" or false (the loss is the answers').
- Refused, naming the field: anything else loraplane cannot honour (full fine-tuning, packing false, training on
  inputs, gradient accumulation, another warm-up ratio or LR floor, early stopping, checkpoints and Hugging Face
  sources to start from, vision, DPO's variants).
- A fine-tune's `model_output_name` (and `adapter_output_name`) is its task's id: /v1/chat/completions takes it as
  `model` once it completed (the best trial's adapter). A checkpoint's `path` is `<task>:<trial>:<step>`.
"""

from __future__ import annotations

from typing import Any

from api.errors import invalid
from api.schemas.common import iso_utc
from api.schemas.events import EventOut
from api.schemas.tasks import TaskOut
from api.schemas.together import FineTune, FineTuneCheckpoint, FineTuneCreate, FineTuneEvent, Progress
from api.schemas.trials import CheckpointOut
from api.services.fine_tuning import one_or_list
from common import search_space as ss

FINE_TUNE_STATUS = {"validating": "pending", "queued": "queued", "running": "running", "succeeded": "completed",
                    "failed": "error", "cancelled": "cancelled"}
# Together's event type nearest to each task event's; any other is "warning" or "job_error" by its level, else
# "job_start" (the task is under way).
EVENT_TYPES = {
    "task.created": "job_pending", "task.planned": "job_pending", "task.waiting": "job_pending",
    "task.waiting_for_model": "model_downloading", "task.model_available": "model_download_complete",
    "task.running": "job_start", "trial.running": "training_start", "pack.started": "training_start",
    "task.refit_started": "training_start", "trial.checkpoint": "checkpoint_save",
    "trial.checkpoint_saved": "checkpoint_save", "trial.adapter_saved": "checkpoint_save",
    "trial.completed": "training_complete", "trial.finished": "training_complete",
    "trial.stopped_early": "early_stopped", "trial.preempted": "job_restarted", "trial.requeued": "job_restarted",
    "trial.restarted": "job_restarted", "trial.resumed": "job_restarted", "task.succeeded": "job_complete",
    "task.failed": "job_error", "trial.failed": "job_error", "pack.failed": "job_error",
    "task.cancelled": "job_stopped",
}
# What loraplane cannot honour: the field, and why (each refused when given a value other than its no-op).
UNSUPPORTED = {
    "from_checkpoint": "a task starts from its base model; continue from an adapter is not supported",
    "from_hf_model": "a task starts from a registered base model (GET /v1/models)",
    "hf_model_revision": "a task starts from a registered base model (GET /v1/models)",
    "hf_api_token": "loraplane does not read from or push to the Hugging Face Hub",
    "hf_output_repo_name": "loraplane does not push to the Hugging Face Hub; download the adapter "
                           "(GET /v1/tasks/{id}/adapter)",
    "wandb_base_url": "runs are logged to W&B's own service",
    "early_stopping_enabled": "a task stops trials early by its early_exit policy (alto or asha: POST /v1/tasks)",
    "early_stopping_patience": "a task stops trials early by its early_exit policy (alto or asha: POST /v1/tasks)",
    "early_stopping_min_delta": "a task stops trials early by its early_exit policy (alto or asha: POST /v1/tasks)",
    "early_stopping_warmup_evals": "a task stops trials early by its early_exit policy (alto or asha: POST /v1/tasks)",
}
LORA_DIMENSIONS = (("lora_r", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout"))
# A task request's location -> the fine-tune request's field it came from (the rest keep their names).
TASK_FIELDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("base_model",): ("model",), ("epochs",): ("n_epochs",), ("seed",): ("random_seed",),
    ("max_seq_len",): ("max_seq_length",), ("search_space", "learning_rate"): ("learning_rate",),
    ("search_space", "batch_size"): ("batch_size",), ("search_space", "lora_rank"): ("training_type", "lora_r"),
    ("search_space", "lora_alpha"): ("training_type", "lora_alpha"),
    ("search_space", "lora_dropout"): ("training_type", "lora_dropout"),
    ("search_space", "target_modules"): ("training_type", "lora_trainable_modules"),
    ("search_space", "beta"): ("training_method", "dpo_beta"), ("training", "weight_decay"): ("weight_decay",),
    ("training", "max_grad_norm"): ("max_grad_norm",),
}
WANDB_FIELDS = {"project": "wandb_project_name", "entity": "wandb_entity", "api_key": "wandb_key"}


def _refuse(param: str, why: str) -> None:
    raise invalid(f"{param}: {why}.", param=param, code="unsupported_field")


def check_supported(body: FineTuneCreate) -> None:
    """A 422 naming the first field loraplane cannot honour."""
    for name, why in UNSUPPORTED.items():
        if getattr(body, name) not in (None, False):
            _refuse(name, why)
    if not body.packing:
        _refuse("packing", "rows always go end to end in one token stream (sequence packing)")
    if body.gradient_accumulation_steps not in (None, 0, 1):
        _refuse("gradient_accumulation_steps", "a trial's step is one batch; give a larger batch_size")
    if body.training_type is not None and body.training_type.type != "Lora":
        _refuse("training_type.type", "loraplane trains LoRA adapters only, not full fine-tunes (lora=True)")
    if body.multimodal_params is not None and body.multimodal_params.train_vision:
        _refuse("multimodal_params.train_vision", "loraplane trains text models only")
    if body.warmup_ratio not in (None, 0, ss.DEFAULT_WARMUP_RATIO):
        _refuse("warmup_ratio", f"a trial warms up over {ss.DEFAULT_WARMUP_RATIO:g} of its steps by default, or a "
                "fixed training.warmup_steps (POST /v1/tasks); give 0 (none) or 0.03")
    args = body.lr_scheduler.lr_scheduler_args if body.lr_scheduler is not None else None
    if args is not None and args.min_lr_ratio not in (None, 0):
        _refuse("lr_scheduler.lr_scheduler_args.min_lr_ratio", "the learning rate decays to zero; give 0")
    if args is not None and args.num_cycles not in (None, 0.5):
        _refuse("lr_scheduler.lr_scheduler_args.num_cycles", "the cosine schedule is one half cycle; give 0.5")
    method = body.training_method
    if method is None:
        return
    if method.train_on_inputs is True:
        _refuse("training_method.train_on_inputs", "the loss is the answers' only (prompts and user turns masked)")
    if method.method == "sft" and method.dpo_beta is not None:
        _refuse("training_method.dpo_beta", "dpo_beta is a parameter of DPO (training_method \"dpo\")")
    for name in ("dpo_normalize_logratios_by_length", "dpo_reference_free", "rpo_alpha", "simpo_gamma"):
        if getattr(method, name):
            _refuse(f"training_method.{name}", "loraplane's DPO is the paper's, against the base model (sigmoid or "
                    "IPO loss: POST /v1/tasks)")


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _modules(text: str) -> Any:
    """One choice of target_modules from Together's text: "all-linear", or module names separated by commas."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    return "all-linear" if names == ["all-linear"] else [names]


def task_body(body: FineTuneCreate) -> dict[str, Any]:
    """The task request (`TaskCreate`'s JSON) of a fine-tune request, once `check_supported` passed it."""
    check_supported(body)
    if body.model is None:
        raise invalid("model: give the base model (GET /v1/models).", param="model", code="missing_field")
    space: dict[str, Any] = {}
    if body.learning_rate is not None and body.learning_rate != "auto":
        space["learning_rate"] = _listed(body.learning_rate)
    if body.batch_size is not None and body.batch_size != "auto":
        space["batch_size"] = _listed(body.batch_size)
    lora = body.training_type
    if lora is not None:
        for theirs, ours in LORA_DIMENSIONS:
            value = getattr(lora, theirs)
            if value is not None and value != "auto":
                space[ours] = _listed(value)
        if lora.lora_trainable_modules:
            space["target_modules"] = _modules(lora.lora_trainable_modules)
    dpo = body.training_method is not None and body.training_method.method == "dpo"
    beta = body.training_method.dpo_beta if body.training_method is not None else None
    if dpo and beta is not None and beta != "auto":
        space["beta"] = _listed(beta)
    task: dict[str, Any] = {"base_model": body.model, "training_file": body.training_file, "search_space": space}
    optional = {"validation_file": body.validation_file or None, "suffix": body.suffix, "seed": body.random_seed,
                "epochs": body.n_epochs, "max_seq_len": body.max_seq_length}
    task.update({k: v for k, v in optional.items() if v is not None})
    training: dict[str, Any] = {}
    if body.lr_scheduler is not None:
        training["lr_schedule"] = body.lr_scheduler.lr_scheduler_type
    if body.warmup_ratio == 0:
        training["warmup_steps"] = 0
    if body.max_grad_norm is not None:
        training["max_grad_norm"] = body.max_grad_norm or None  # Together's 0: no clipping
    if body.weight_decay is not None:
        training["weight_decay"] = body.weight_decay
    if training:
        task["training"] = training
    if dpo:
        task["objective"] = {"type": "dpo"}
    if body.wandb_key is not None or body.wandb_project_name is not None or body.wandb_entity is not None:
        task["integrations"] = [{"type": "wandb", "project": body.wandb_project_name, "mode": "online",
                                 **{k: v for k, v in (("entity", body.wandb_entity), ("api_key", body.wandb_key))
                                    if v is not None}}]
    return task


def together_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Where a task request's error lies, in the fine-tune request's names (`search_space.lora_rank[0]` ->
    `training_type.lora_r[0]`, the W&B tracker's fields -> `wandb_*`); a location of no mapped field keeps its own."""
    if loc and loc[0] == "integrations":
        field = next((WANDB_FIELDS[p] for p in reversed(loc) if isinstance(p, str) and p in WANDB_FIELDS), None)
        return (field or "wandb_key",)
    for size in (2, 1):
        head = tuple(str(part) for part in loc[:size])
        if head in TASK_FIELDS:
            return (*TASK_FIELDS[head], *loc[size:])
    return loc


def _modules_text(choice: Any) -> str:
    """A choice of target_modules as Together writes it: "all-linear" or names separated by commas."""
    return choice if isinstance(choice, str) else ",".join(choice)


def _training_type(space: dict[str, Any]) -> dict[str, Any]:
    rank = one_or_list(space.get("lora_rank", ss.DEFAULTS["lora_rank"]))
    alpha = space.get("lora_alpha")
    modules = space.get("target_modules", ss.DEFAULTS["target_modules"])
    return {"type": "Lora", "lora_r": rank,
            "lora_alpha": one_or_list(alpha) if alpha is not None else (2 * rank if isinstance(rank, int) else None),
            "lora_dropout": one_or_list(space.get("lora_dropout", ss.DEFAULTS["lora_dropout"])),
            "lora_trainable_modules": one_or_list([_modules_text(c) for c in modules])}


def _warmup_ratio(training: dict[str, Any]) -> float | None:
    """0 for no warm-up, our default ratio for the default; None for a fixed number of steps (no ratio)."""
    steps = training.get("warmup_steps")
    return 0.0 if steps == 0 else ss.DEFAULT_WARMUP_RATIO if steps is None else None


def fine_tune_of(task: TaskOut, events: list[FineTuneEvent] | None = None) -> FineTune:
    """The fine-tune of a task; retrieve's carries its ``events``."""
    space, training = task.search_space, task.training
    dpo = task.objective.get("type") == "dpo"
    method: dict[str, Any] = ({"method": "dpo", "dpo_beta": one_or_list(space.get("beta", ss.DEFAULT_DPO_BETA))}
                              if dpo else {"method": "sft", "train_on_inputs": "auto"})
    left = task.estimated_seconds_left
    actual = task.estimate.actual if task.estimate is not None else None
    tracker = next((i for i in task.integrations if i.get("type") == "wandb"), {})
    assert task.id is not None
    return FineTune(
        id=task.id, status=FINE_TUNE_STATUS[task.state],  # type: ignore[arg-type]
        created_at=iso_utc(task.created_at),
        updated_at=iso_utc(task.finished_at or task.started_at or task.created_at),
        started_at=iso_utc(task.started_at) if task.started_at is not None else None,
        user_id=task.tenant_id, model=task.base_model, model_output_name=task.id, adapter_output_name=task.id,
        training_file=task.training_file, validation_file=task.validation_file, n_epochs=task.epochs or 1,
        batch_size=one_or_list(space.get("batch_size", ss.DEFAULTS["batch_size"])),
        learning_rate=one_or_list(space["learning_rate"]) if "learning_rate" in space else None,
        lr_scheduler={"lr_scheduler_type": training.get("lr_schedule", ss.DEFAULT_LR_SCHEDULE),
                      "lr_scheduler_args": {"min_lr_ratio": 0.0, "num_cycles": 0.5}},
        warmup_ratio=_warmup_ratio(training), max_grad_norm=training.get("max_grad_norm") or 0.0,
        weight_decay=training.get("weight_decay", 0.0), max_seq_length=task.max_seq_len, random_seed=task.seed,
        suffix=task.suffix, training_type=_training_type(space), training_method=method,
        token_count=actual.tokens if actual is not None else None,
        wandb_project_name=tracker.get("project"), wandb_entity=tracker.get("entity"),
        progress=Progress(estimate_available=left is not None, seconds_remaining=int(left or 0)), events=events,
        loraplane={"task_id": task.id, "state": task.state, "trial_counts": task.trial_counts.model_dump(),
                   "best_trial": task.best_trial.model_dump() if task.best_trial is not None else None,
                   "progress": task.progress, "error": task.error},
    )


def fine_tune_event(event: EventOut) -> FineTuneEvent:
    level = event.level if event.level in ("warning", "error") else "info"
    kind = EVENT_TYPES.get(event.type) or {"warning": "warning", "error": "job_error"}.get(level, "job_start")
    step = event.data.get("step")
    return FineTuneEvent(created_at=iso_utc(event.created_at), level=level,  # type: ignore[arg-type]
                         message=event.message, type=kind, step=step if isinstance(step, int) else None,
                         loraplane={"id": event.id, "type": event.type, "trial_id": event.trial_id})


def fine_tune_checkpoint(checkpoint: CheckpointOut) -> FineTuneCheckpoint:
    return FineTuneCheckpoint(
        checkpoint_type=f"{'Final' if 'last' in checkpoint.kinds else 'Intermediate'} (step {checkpoint.step})",
        created_at=iso_utc(checkpoint.created_at), path=checkpoint.model, step=checkpoint.step,
        object_name=checkpoint.model, kinds=list(checkpoint.kinds))
