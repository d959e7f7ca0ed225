"""Trials of a task and their loss curves (and metric scores)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas.common import UtcDateTime
from common.tables import Checkpoint, Trial


class TrialOut(BaseModel):
    id: str
    object: Literal["trial"] = "trial"
    task_id: str
    index: int
    state: str
    hyperparameters: dict[str, Any]
    total_steps: int
    steps_done: int
    best_val_loss: float | None
    best_step: int | None
    last_train_loss: float | None
    metric_score: float | None = Field(
        description="The share of validation rows its best adapter answered right by the task's generative "
        "metric (null for the loss metric, and until it has ended).")
    stop_reason: str | None
    error: str | None
    attempts: int
    checkpoint_step: int | None  # the newest checkpoint a requeued trial would resume from
    adapter_ready: bool = Field(description="Whether its adapter can be downloaded (GET .../adapter).")
    refit_of: str | None = Field(default=None, description="A refit's: the trial whose configuration it trains "
                                 "again on the training and validation rows (null for the search's trials).")
    created_at: UtcDateTime
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None

    @classmethod
    def of(cls, t: Trial) -> TrialOut:
        return cls(
            id=t.id, task_id=t.task_id, index=t.index, state=t.state, hyperparameters=t.hyperparameters,
            total_steps=t.total_steps, steps_done=t.steps_done, best_val_loss=t.best_val_loss,
            best_step=t.best_step, last_train_loss=t.last_train_loss, metric_score=t.metric_score,
            stop_reason=t.stop_reason,
            error=t.error, attempts=t.attempts, checkpoint_step=t.checkpoint_step,
            adapter_ready=t.adapter_key is not None, refit_of=t.refit_of, created_at=t.created_at,
            started_at=t.started_at, finished_at=t.finished_at,
        )


class LossPoint(BaseModel):
    step: int
    loss: float


class MetricScore(BaseModel):
    step: int
    score: float = Field(description="The share of validation rows that passed the task's metric, in [0, 1].")


class TrialMetrics(BaseModel):
    trial_id: str
    object: Literal["trial.metrics"] = "trial.metrics"
    train: list[LossPoint]
    val: list[LossPoint]
    metric: list[MetricScore] = Field(
        default_factory=list, description="Scores on the task's generative metric (one when the trial ended).")


class CheckpointDeleted(BaseModel):
    object: Literal["checkpoint"] = "checkpoint"
    trial_id: str
    step: int
    deleted: Literal[True] = True


class CheckpointOut(BaseModel):
    object: Literal["checkpoint"] = "checkpoint"
    task_id: str
    trial_id: str
    step: int
    epoch: float = Field(description="Its step over the steps of one epoch (2.0: the end of the second).")
    kinds: list[Literal["best", "last", "epoch"]] = Field(
        description="best: the lowest validation loss of the kept ones; last: the newest (the trial's last step once "
                    "it has ended); epoch: it ends an epoch.")
    val_loss: float | None = Field(description="Its validation loss (null where it was not validated).")
    metric_score: float | None = Field(
        description="The task's generative metric of the best checkpoint, once its trial has ended (null otherwise: "
                    "only the best adapter is scored).")
    size_bytes: int = Field(description="Its archive's bytes, counted in the tenant's stored bytes.")
    model: str = Field(description='What to name it as `model` in POST /v1/chat/completions ("task:trial:step").')
    created_at: UtcDateTime

    @classmethod
    def of(cls, c: Checkpoint, kinds: list[str], metric_score: float | None) -> CheckpointOut:
        return cls(task_id=c.task_id, trial_id=c.trial_id, step=c.step, epoch=c.epoch,
                   kinds=kinds,  # type: ignore[arg-type]  # common.checkpoints' kinds are these three
                   val_loss=c.val_loss, metric_score=metric_score, size_bytes=c.size_bytes,
                   model=f"{c.task_id}:{c.trial_id}:{c.step}", created_at=c.created_at)
