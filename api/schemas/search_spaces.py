"""The search-space preview: how many trials a space expands to, before a task is submitted."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictInt

from api.schemas.common import FiniteFloat, RequestModel, Text
from api.schemas.tasks import (
    MAX_MAX_SEQ_LEN,
    MIN_MAX_SEQ_LEN,
    CostEstimate,
    Objective,
    Scheduling,
    SearchSpaceOrAuto,
    TaskCreate,
)


class SearchSpaceExpand(RequestModel):
    """The fields of a task that decide its trials, with the same names, rules and defaults as
    `POST /v1/tasks`, so an error names the same place (`search_space.lora_rank.max`)."""

    base_model: Text | None = Field(
        default=None, min_length=1, max_length=100,
        description="Check target_modules against this model (as a task would) and say what all-linear is on it.")
    search_space: SearchSpaceOrAuto = Field(description='The dimensions, or "auto" (with base_model and '
                                           "training_file): the space a task with \"auto\" gets.")
    strategy: Literal["grid", "random"] = "grid"
    max_trials: Annotated[StrictInt, Field(ge=1, le=10_000)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 0
    # The task's budget, for the estimate (with base_model and training_file; without them `estimate` is null).
    training_file: Text | None = Field(
        default=None, min_length=1, max_length=200,
        description="With base_model: estimate the task's cost (its row count sets each trial's steps).")
    validation_file: Text | None = Field(default=None, min_length=1, max_length=200)
    validation_split: Annotated[FiniteFloat, Field(gt=0, le=0.5)] | None = None
    epochs: Annotated[StrictInt, Field(ge=1, le=100)] | None = None
    max_steps: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    max_seq_len: Annotated[StrictInt, Field(ge=MIN_MAX_SEQ_LEN, le=MAX_MAX_SEQ_LEN)] = \
        TaskCreate.model_fields["max_seq_len"].default
    scheduling: Scheduling = Field(default_factory=Scheduling)
    objective: Objective = Field(default_factory=Objective, description="A DPO task's defaults differ (its "
                                 "learning rates a tenth of SFT's, its beta 0.1).")


class SearchSpaceExpansion(BaseModel):
    object: Literal["search_space.expansion"] = "search_space.expansion"
    strategy: str
    count: int = Field(description="How many trials a task with this space gets.")
    max_trials_per_task: int = Field(description="This tenant's quota of trials per task.")
    trials: list[dict[str, Any]] = Field(description="The trials' hyperparameters, in trial order (at most `limit`).")
    has_more: bool = Field(description="Whether trials were left out of `trials`.")
    all_linear: list[str] | None = Field(
        default=None, description='The modules "all-linear" stands for on base_model (every linear layer of the '
        "decoder except lm_head); null without base_model or where its architecture is not known.")
    estimate: CostEstimate | None = Field(
        default=None, description="The task's predicted tokens, GPU seconds and wall seconds on the cluster now, with "
        "its band and basis, as its submission would store them; null without base_model and training_file.")
