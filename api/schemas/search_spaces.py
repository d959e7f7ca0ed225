"""The search-space preview: how many trials a space expands to, before a task is submitted."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictInt

from api.schemas.common import RequestModel, Text
from api.schemas.tasks import SearchSpace


class SearchSpaceExpand(RequestModel):
    """The fields of a task that decide its trials, with the same names, rules and defaults as
    `POST /v1/tasks`, so an error names the same place (`search_space.lora_rank.max`)."""

    base_model: Text | None = Field(
        default=None, min_length=1, max_length=100,
        description="Check target_modules against this model (as a task would) and say what all-linear is on it.")
    search_space: SearchSpace
    strategy: Literal["grid", "random"] = "grid"
    max_trials: Annotated[StrictInt, Field(ge=1, le=10_000)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 0


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
