"""OpenAI's fine-tuning jobs (issue 38): the request and the objects of `/v1/fine_tuning/jobs`, in OpenAI's shapes, so
that the official `openai` client drives the service unchanged. A job is a task (api/services/fine_tuning.py maps one
to the other); what OpenAI takes as a number may be a list here, which makes the job a search (our extension)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictInt, TypeAdapter, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from api.schemas.common import FiniteFloat, RequestModel, Text
from api.schemas.tasks import MetadataKey, MetadataValue, ModuleChoice

Auto = Literal["auto"]
PositiveFloat = Annotated[FiniteFloat, Field(gt=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
Fraction = Annotated[FiniteFloat, Field(ge=0, lt=1)]


def _searched(item: Any, *, lists: bool = True) -> WrapValidator:
    """A number, "auto" (the service's default) or, our extension, a non-empty list of numbers to search over;
    dispatched on the input's shape (as the task's search space is), so that an error names the field, not a member
    of the union."""
    one: TypeAdapter[Any] = TypeAdapter(item)
    several: TypeAdapter[list[Any]] = TypeAdapter(list[item])

    def validate(v: Any, _handler: ValidatorFunctionWrapHandler) -> Any:
        if v == "auto":
            return v
        if isinstance(v, list) and lists:
            if not v:
                raise PydanticCustomError("empty_list", "List at least one value.")
            return several.validate_python(v)
        return one.validate_python(v)

    return WrapValidator(validate)


Searched = Annotated[PositiveFloat | Auto | list[PositiveFloat], _searched(PositiveFloat)]
SearchedInt = Annotated[PositiveInt | Auto | list[PositiveInt], _searched(PositiveInt)]
SearchedFraction = Annotated[Fraction | Auto | list[Fraction], _searched(Fraction)]
Epochs = Annotated[Annotated[StrictInt, Field(ge=1, le=100)] | Auto,
                   _searched(Annotated[StrictInt, Field(ge=1, le=100)], lists=False)]  # not a search dimension


class JobHyperparameters(RequestModel):
    """OpenAI's hyperparameters, and ours beside them (a list anywhere OpenAI takes one number: a search)."""

    n_epochs: Epochs | None = Field(
        default=None, description="Passes over the training rows (default 1).")
    batch_size: SearchedInt | None = None
    learning_rate_multiplier: Searched | None = Field(
        default=None, description="Times the service's default learning rate for the model's size (1e-3 below 1B "
        "parameters, 2e-4 below 20B or unknown, 1e-4 above; a DPO job's a tenth of it).")
    beta: Searched | None = Field(default=None, description="DPO only: the pull towards the base model (default 0.1).")
    # Our extensions: the search space's other dimensions.
    learning_rate: Searched | None = Field(default=None, description="An absolute rate instead of the multiplier.")
    lora_rank: SearchedInt | None = None
    lora_alpha: Searched | None = None
    lora_dropout: SearchedFraction | None = None
    target_modules: list[ModuleChoice] | Literal["all-linear"] | None = None


class SupervisedMethod(RequestModel):
    hyperparameters: JobHyperparameters | None = None


class DpoMethod(RequestModel):
    hyperparameters: JobHyperparameters | None = None


class JobMethod(RequestModel):
    type: Literal["supervised", "dpo"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None


class WandbSettings(RequestModel):
    project: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    entity: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    name: str | None = Field(default=None, max_length=128, description="Ignored: a run is named by its trial.")
    tags: list[str] | None = Field(default=None, max_length=50, description="Ignored.")
    # Ours: OpenAI logs under the W&B key of the organisation's settings; here the job gives it (online), or logs
    # offline on the service's side (for `wandb sync`).
    api_key: Text | None = Field(default=None, min_length=1, max_length=200)
    mode: Literal["online", "offline"] = "online"


class JobIntegration(RequestModel):
    """OpenAI's integration shape: `{"type": "wandb", "wandb": {"project", "entity", ...}}`."""

    type: Literal["wandb"]
    wandb: WandbSettings


class JobCreate(RequestModel):
    """`POST /v1/fine_tuning/jobs`, as OpenAI's `client.fine_tuning.jobs.create` sends it."""

    model: Text = Field(min_length=1, max_length=100, description="A base model of GET /v1/models.")
    training_file: Text = Field(min_length=1, max_length=200)
    validation_file: Text | None = Field(default=None, min_length=1, max_length=200)
    hyperparameters: JobHyperparameters | None = Field(
        default=None, description="OpenAI's older place for them; `method.<type>.hyperparameters` is the newer.")
    method: JobMethod | None = None
    suffix: Text | None = Field(default=None, min_length=1, max_length=64)
    seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    integrations: list[JobIntegration] | None = Field(default=None, max_length=4)


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(BaseModel):
    """OpenAI's `fine_tuning.job`, of one task; `loraplane` says what OpenAI's has no place for (its trials)."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    model: str
    fine_tuned_model: str | None = Field(description="Once succeeded: the `model` to name in /v1/chat/completions "
                                         "(the task's best trial).")
    organization_id: str
    result_files: list[str] = Field(default_factory=list)
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
    training_file: str
    validation_file: str | None
    hyperparameters: dict[str, Any]
    method: dict[str, Any]
    trained_tokens: int | None
    error: JobError | None
    seed: int
    estimated_finish: int | None
    integrations: list[dict[str, Any]]
    metadata: dict[str, str] | None
    user_provided_suffix: str | None
    loraplane: dict[str, Any] = Field(description="The task behind the job: its trials and its best so far.")


class JobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    data: dict[str, Any]
    type: Literal["message"] = "message"


class JobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(description="The `model` to name in /v1/chat/completions.")
    fine_tuning_job_id: str
    metrics: dict[str, float | None]
    step_number: int
