"""A task's experiment trackers and how far each trial's run is synced there."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TrackerRunOut(BaseModel):
    trial_id: str
    trial_index: int
    run_id: str | None = Field(description="The run's id in the tracker (null until it is created there).")
    finished: bool = Field(description="Its end (status, stop reason, adapter) is logged: nothing left to sync.")
    attempts: int = Field(description="Failed attempts in a row (0: in step with the trial).")
    last_error: str | None = Field(description="Why the last attempt failed, while the tracker is behind.")


class TrackerOut(BaseModel):
    object: Literal["integration"] = "integration"
    id: str
    type: Literal["mlflow", "wandb"]
    tracking_uri: str = Field(description="MLflow's server; for W&B, W&B's service.")
    experiment: str = Field(description="MLflow's experiment, or W&B's project.")
    entity: str | None = Field(default=None, description="W&B's entity (null: the API key's default).")
    mode: Literal["online", "offline"] | None = Field(default=None, description="W&B's mode.")
    token_set: bool
    done: bool = Field(description="Every trial's run is finished there.")
    runs: list[TrackerRunOut]
