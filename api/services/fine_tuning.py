"""OpenAI's fine-tuning jobs as tasks (issue 38), both ways, with no I/O: a job request becomes a task request
(`task_body`), a task becomes a job (`job_of`), its events and its best trial's checkpoints become OpenAI's
(`job_event`, `job_checkpoint`). The routes (api/routes/fine_tuning.py) run the task's own services between them, so a
job is checked, estimated, trained, isolated and cancelled exactly as a task is.

What maps to what:
- `model` is the base model; `method.type` "supervised" an SFT task, "dpo" a DPO one (`objective`); the hyperparameters
  come from `method.<type>.hyperparameters` or the older top-level `hyperparameters` (not both).
- `n_epochs` is `epochs`; `batch_size`, `beta` and our extensions (`learning_rate`, `lora_rank`, `lora_alpha`,
  `lora_dropout`, `target_modules`) are search-space dimensions; `learning_rate_multiplier` times the service's default
  learning rate for the model's size (`common.search_space.default_learning_rate`; a DPO job's scaled as a DPO task's)
  is the learning rate. "auto" leaves a value to the service. A list where OpenAI takes a number makes the job a
  search over it: the task's trials, packed together, the best one the job's `fine_tuned_model`.
- `integrations` of type wandb are the task's W&B tracker; `suffix`, `seed` and `metadata` are the task's.
- A job's `fine_tuned_model` is its task's id once it succeeded: /v1/chat/completions takes it as `model` (the best
  trial's adapter). A checkpoint's is `<task>:<trial>:<step>`.
"""

from __future__ import annotations

from typing import Any

from api.errors import invalid
from api.schemas.events import EventOut
from api.schemas.fine_tuning import FineTuningJob, JobCheckpoint, JobCreate, JobError, JobEvent, JobHyperparameters
from api.schemas.tasks import TaskOut
from api.schemas.trials import CheckpointOut
from common import search_space as ss

JOB_STATUS = {"validating": "validating_files", "queued": "queued", "running": "running", "succeeded": "succeeded",
              "failed": "failed", "cancelled": "cancelled"}
# The hyperparameters that are search-space dimensions under their own names.
DIMENSIONS = ("batch_size", "beta", "learning_rate", "lora_rank", "lora_alpha", "lora_dropout")


def default_learning_rate(parameters: int | None, *, dpo: bool) -> float:
    """What `learning_rate_multiplier` multiplies: the learning rate a task of this model gets by default."""
    rate = ss.default_learning_rate(parameters) * (ss.DPO_LR_SCALE if dpo else 1.0)
    return float(f"{rate:.12g}")


def is_dpo(job: JobCreate) -> bool:
    return job.method is not None and job.method.type == "dpo"


def hyperparameters_of(job: JobCreate) -> JobHyperparameters:
    """The job's hyperparameters: its method's, or the older top-level ones (not both)."""
    method = job.method
    inner = None
    if method is not None:
        held = method.dpo if method.type == "dpo" else method.supervised
        inner = held.hyperparameters if held is not None else None
    if inner is not None and job.hyperparameters is not None:
        raise invalid("Give hyperparameters in method or at the top level, not both.", param="hyperparameters",
                      code="conflicting_fields")
    hp = inner or job.hyperparameters or JobHyperparameters()
    if hp.beta is not None and not is_dpo(job):
        raise invalid("beta is a hyperparameter of DPO jobs (method.type \"dpo\").", param="hyperparameters.beta",
                      code="unknown_field")
    return hp


def task_body(job: JobCreate, parameters: int | None) -> dict[str, Any]:
    """The task request (`TaskCreate`'s JSON) of a job request, for a base model of ``parameters`` (None: unknown)."""
    hp = hyperparameters_of(job)
    space: dict[str, Any] = {}
    for name in DIMENSIONS:
        value = getattr(hp, name)
        if value is not None and value != "auto":
            space[name] = value if isinstance(value, list) else [value]
    if hp.target_modules is not None:
        space["target_modules"] = hp.target_modules
    multiplier = hp.learning_rate_multiplier
    if multiplier is not None and multiplier != "auto":
        if "learning_rate" in space:
            raise invalid("Give learning_rate_multiplier or learning_rate, not both.",
                          param="hyperparameters.learning_rate", code="conflicting_fields")
        base = default_learning_rate(parameters, dpo=is_dpo(job))
        space["learning_rate"] = [float(f"{m * base:.12g}") for m in (multiplier if isinstance(multiplier, list)
                                                                       else [multiplier])]
    body: dict[str, Any] = {"base_model": job.model, "training_file": job.training_file, "search_space": space}
    optional = {"validation_file": job.validation_file, "suffix": job.suffix, "seed": job.seed,
                "metadata": job.metadata, "epochs": hp.n_epochs if hp.n_epochs != "auto" else None}
    body.update({k: v for k, v in optional.items() if v is not None})
    if is_dpo(job):
        body["objective"] = {"type": "dpo"}
    if job.integrations:
        body["integrations"] = [{"type": "wandb", "project": i.wandb.project, "mode": i.wandb.mode,
                                 **{k: v for k, v in (("entity", i.wandb.entity), ("api_key", i.wandb.api_key)) if v}}
                                for i in job.integrations]
    return body


def one_or_list(values: Any) -> Any:
    """A dimension of the stored space as OpenAI and Together show a hyperparameter: one value as itself, several as
    the list (a range as its object)."""
    return values[0] if isinstance(values, list) and len(values) == 1 else values


def _seconds(moment: Any) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def job_of(task: TaskOut, parameters: int | None, now: float) -> FineTuningJob:
    """The job of a task (its base model of ``parameters``, for the learning rate's multiplier) at ``now`` (epoch
    seconds: its estimated finish is now plus the task's estimated seconds left)."""
    dpo = task.objective.get("type") == "dpo"
    space = task.search_space
    rates = space.get("learning_rate")
    base = default_learning_rate(parameters, dpo=dpo)
    multiplier = ([float(f"{r / base:.6g}") for r in rates] if isinstance(rates, list) else "auto")
    hyperparameters: dict[str, Any] = {"n_epochs": task.epochs or "auto",
                                       "batch_size": one_or_list(space.get("batch_size", "auto")),
                                       "learning_rate_multiplier": one_or_list(multiplier)}
    if dpo:
        hyperparameters["beta"] = one_or_list(space.get("beta", "auto"))
    method = "dpo" if dpo else "supervised"
    started = _seconds(task.created_at)
    assert task.id is not None and started is not None
    left = task.estimated_seconds_left
    actual = task.estimate.actual if task.estimate is not None else None
    return FineTuningJob(
        id=task.id, created_at=started, finished_at=_seconds(task.finished_at), model=task.base_model,
        fine_tuned_model=task.id if task.state == "succeeded" and task.best_trial is not None else None,
        organization_id=task.tenant_id, status=JOB_STATUS[task.state],  # type: ignore[arg-type]
        training_file=task.training_file, validation_file=task.validation_file, hyperparameters=hyperparameters,
        method={"type": method, method: {"hyperparameters": hyperparameters}},
        trained_tokens=actual.tokens if actual is not None else None,
        error=JobError(code="task_failed", message=task.error or "failed") if task.state == "failed" else None,
        seed=task.seed, estimated_finish=int(now + left) if left is not None else None,
        integrations=[{"type": i.get("type"), i.get("type", "tracker"): {k: v for k, v in i.items() if k != "type"}}
                      for i in task.integrations],
        metadata=task.metadata, user_provided_suffix=task.suffix,
        loraplane={"task_id": task.id, "trial_counts": task.trial_counts.model_dump(),
                   "best_trial": task.best_trial.model_dump() if task.best_trial is not None else None,
                   "progress": task.progress},
    )


def job_event(event: EventOut) -> JobEvent:
    return JobEvent(id=f"ftevent-{event.id}", created_at=int(event.created_at.timestamp()), level=event.level,
                    message=event.message, data={"type": event.type, "trial_id": event.trial_id, **event.data})


def event_cursor(after: str | None) -> int | None:
    """The event id of a `ftevent-<n>` cursor (a bare number too); a cursor of neither shape is a 422."""
    if after is None:
        return None
    digits = after.removeprefix("ftevent-")
    if not digits.isdigit() or len(digits) > 18:
        raise invalid(f"'{after}' is not an event id of this job (ftevent-<number>).", param="after",
                      code="invalid_cursor")
    return int(digits)


def job_checkpoint(checkpoint: CheckpointOut) -> JobCheckpoint:
    return JobCheckpoint(
        id=f"ftckpt-{checkpoint.trial_id}-{checkpoint.step}", created_at=int(checkpoint.created_at.timestamp()),
        fine_tuned_model_checkpoint=checkpoint.model, fine_tuning_job_id=checkpoint.task_id,
        metrics={"step": float(checkpoint.step), "valid_loss": checkpoint.val_loss, "epoch": checkpoint.epoch},
        step_number=checkpoint.step)
