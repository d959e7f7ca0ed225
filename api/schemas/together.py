"""Together AI's fine-tuning API: the request and the objects of `/v1/fine-tunes`, in the shapes of the official
`together` client (3.1), so that it drives the service unchanged. A fine-tune is a task (api/services/together.py maps
one to the other); what Together takes as a number may be a list here, which makes the fine-tune a search (our
extension: the client's own request model refuses lists, so they come through a raw POST)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, StrictBool, StrictInt

from api.schemas.common import FiniteFloat, RequestModel, Text
from api.schemas.fine_tuning import Searched, SearchedFraction, SearchedInt

Count = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
# Together's batch size "max" leaves it to the service, as our "auto" does.
BatchSize = Annotated[SearchedInt, BeforeValidator(lambda v: "auto" if v == "max" else v)]


class LrSchedulerArgs(RequestModel):
    min_lr_ratio: FiniteFloat | None = None
    num_cycles: FiniteFloat | None = None


class LrScheduler(RequestModel):
    lr_scheduler_type: Literal["linear", "cosine"]
    lr_scheduler_args: LrSchedulerArgs | None = None


class TrainingType(RequestModel):
    """`{"type": "Lora", "lora_r", "lora_alpha", "lora_dropout", "lora_trainable_modules"}`, or "Full" (refused)."""

    type: Literal["Lora", "Full", ""]
    lora_r: SearchedInt | None = None
    lora_alpha: Searched | None = None
    lora_dropout: SearchedFraction | None = None
    lora_trainable_modules: Text | None = Field(default=None, max_length=500,
                                                description='"all-linear" or module names separated by commas.')


class TrainingMethod(RequestModel):
    """`{"method": "sft", "train_on_inputs"}` or `{"method": "dpo", "dpo_beta", ...}`."""

    method: Literal["sft", "dpo"]
    train_on_inputs: StrictBool | Literal["auto"] | None = None
    dpo_beta: Searched | None = None
    dpo_normalize_logratios_by_length: StrictBool | None = None
    dpo_reference_free: StrictBool | None = None
    rpo_alpha: FiniteFloat | None = None
    simpo_gamma: FiniteFloat | None = None


class MultimodalParams(RequestModel):
    train_vision: StrictBool = False


class FineTuneCreate(RequestModel):
    """`POST /v1/fine-tunes`, as `client.fine_tuning.create` sends it (`FinetuneRequest.model_dump(exclude_none=True)`).
    Every field the client may send is named here; those loraplane cannot honour are refused by the mapping, naming
    the field."""

    training_file: Text = Field(min_length=1, max_length=200)
    validation_file: Text | None = Field(default=None, max_length=200, description='"": none (the client\'s default).')
    packing: StrictBool = True
    model: Text | None = Field(default=None, max_length=100, description="A base model of GET /v1/models.")
    n_epochs: Annotated[StrictInt, Field(ge=1, le=100)] | None = None
    learning_rate: Searched | None = Field(default=None, description="An absolute rate (a list: a search).")
    lr_scheduler: LrScheduler | None = None
    warmup_ratio: FiniteFloat | None = None
    max_grad_norm: Annotated[FiniteFloat, Field(ge=0)] | None = None
    weight_decay: FiniteFloat | None = None
    n_checkpoints: Count | None = None
    n_evals: Count | None = None
    max_seq_length: Count | None = None
    batch_size: BatchSize | None = None
    gradient_accumulation_steps: Count | None = None
    suffix: Text | None = Field(default=None, min_length=1, max_length=64)
    wandb_key: Text | None = Field(default=None, max_length=200)
    wandb_base_url: Text | None = Field(default=None, max_length=2000)
    wandb_project_name: Text | None = Field(default=None, max_length=128)
    wandb_name: Text | None = Field(default=None, max_length=128, description="Ignored: a run is named by its trial.")
    wandb_entity: Text | None = Field(default=None, max_length=128)
    random_seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] | None = None
    early_stopping_enabled: StrictBool | None = None
    early_stopping_patience: StrictInt | None = None
    early_stopping_min_delta: FiniteFloat | None = None
    early_stopping_warmup_evals: StrictInt | None = None
    training_type: TrainingType | None = None
    training_method: TrainingMethod | None = None
    from_checkpoint: Text | None = Field(default=None, max_length=200)
    multimodal_params: MultimodalParams | None = None
    from_hf_model: Text | None = Field(default=None, max_length=200)
    hf_model_revision: Text | None = Field(default=None, max_length=200)
    hf_api_token: Text | None = Field(default=None, max_length=200)
    hf_output_repo_name: Text | None = Field(default=None, max_length=200)


class PriceEstimate(BaseModel):
    """`POST /v1/fine-tunes/estimate-price`: loraplane prices nothing; `estimation_available` false makes the client
    skip its funds check. The reason is the nearest of Together's (this endpoint reads no file), so that even the
    client's strict response validation takes it. A task's own estimate (tokens, GPU seconds, wall time) is
    GET /v1/tasks/{id}'s `estimate`."""

    estimation_available: Literal[False] = False
    unavailable_reason: Literal["train_file_not_validated"] = "train_file_not_validated"


class LoraLimits(BaseModel):
    default_rank: int
    max_batch_size: int
    max_batch_size_dpo: int
    max_rank: int
    min_batch_size: int
    target_modules: list[str]


class ModelLimits(BaseModel):
    """`GET /v1/fine-tunes/models/limits?model_name=`: Together's `FinetuneModelLimits` of a base model, from the
    task request's bounds (the client checks batch size and sequence length against them before it sends)."""

    model_name: str
    default_gradient_accumulation_steps: int = 1
    lora_training: LoraLimits
    full_training: None = None
    max_learning_rate: float
    min_learning_rate: float
    max_num_checkpoints: int
    max_num_epochs: int
    max_num_evals: int
    max_seq_length_sft: int
    max_seq_length_dpo: int
    min_max_seq_length: int
    merge_output_lora: bool = False
    supports_full_training: bool = False
    supports_reasoning: bool = False
    supports_tools: bool = False
    supports_vision: bool = False


class Progress(BaseModel):
    estimate_available: bool
    seconds_remaining: int


class FineTuneEvent(BaseModel):
    """Together's `fine-tune-event`, of one task event (its own type and trial in `loraplane`)."""

    object: Literal["fine-tune-event"] = "fine-tune-event"
    created_at: str
    level: Literal["info", "warning", "error"]
    message: str
    type: str = Field(description="Together's event type nearest to the task event's.")
    step: int | None = None
    loraplane: dict[str, Any]


class FineTune(BaseModel):
    """Together's `FinetuneResponse`, of one task; `loraplane` says what Together's has no place for (its trials)."""

    id: str
    status: Literal["pending", "queued", "running", "completed", "error", "cancelled"]
    created_at: str
    updated_at: str
    started_at: str | None
    user_id: str
    model: str
    model_output_name: str = Field(description="The `model` to name in /v1/chat/completions once completed (the "
                                   "task's best trial).")
    adapter_output_name: str
    training_file: str
    validation_file: str | None
    n_epochs: int | None
    batch_size: Any
    learning_rate: Any
    lr_scheduler: dict[str, Any]
    warmup_ratio: float | None
    max_grad_norm: float | None
    weight_decay: float
    max_seq_length: int
    packing: bool = True
    random_seed: int
    suffix: str | None
    training_type: dict[str, Any]
    training_method: dict[str, Any]
    token_count: int | None
    wandb_project_name: str | None
    wandb_entity: str | None
    progress: Progress
    events: list[FineTuneEvent] | None = Field(default=None, description="Retrieve's only (its newest 1000).")
    loraplane: dict[str, Any] = Field(description="The task behind the fine-tune: its trials and its best so far.")


class FineTuneList(BaseModel):
    data: list[FineTune]


class FineTuneEventList(BaseModel):
    data: list[FineTuneEvent]


class FineTuneCheckpoint(BaseModel):
    """One kept checkpoint of the best trial; `path` (and `object_name`) the `model` that samples it."""

    checkpoint_type: str
    created_at: str
    path: str
    step: int
    checkpoint: Literal["adapter"] = "adapter"
    object_name: str
    kinds: list[str]


class FineTuneCheckpointList(BaseModel):
    data: list[FineTuneCheckpoint]
