"""The cluster as an operator sees it: packs with their slots, and the fleet's utilisation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas.admin import WorkerOut
from api.schemas.common import UtcDateTime
from api.schemas.tasks import TaskWaiting


class PackSlot(BaseModel):
    """A trial that holds a slot of the pack now."""

    trial_id: str
    task_id: str
    tenant_id: str
    index: int = Field(description="The trial's index in its task.")
    state: str
    steps_done: int
    total_steps: int
    awaiting_admission: bool = Field(description="Back-filled, not yet confirmed by the worker.")


class PackPhases(BaseModel):
    """Where a pack's wall time went, in seconds, as its worker measured it (null: that worker did not measure
    the phase; packs of older workers carry fewer). Every phase but `persist_s` is training-thread time and part
    of `wall_s`; `persist_s` runs on the writer thread alongside them (what the pack's end waited for it is
    `idle_s`)."""

    wall_s: float | None = Field(description="The pack's wall time, from its start to its end.")
    load_s: float | None = Field(description="Loading the base model (from the worker's cache or disk).")
    capture_s: float | None = Field(description="Capturing CUDA graphs of the step.")
    steps_s: float | None = Field(description="Training steps: forward, backward, optimizer.")
    validation_s: float | None = Field(description="Validation passes.")
    metric_s: float | None = Field(description="Generation for the trials' generative metric.")
    snapshot_s: float | None = Field(description="Taking checkpoint snapshots of trials.")
    persist_s: float | None = Field(description="Writing checkpoints to the artifact store (writer thread, "
                                                "concurrent with the other phases).")
    export_s: float | None = Field(description="Snapshotting finished trials' adapters for export.")
    idle_s: float | None = Field(description="The pack's end waiting for its writer.")
    other_s: float | None = Field(description="wall_s less every training-thread phase above (callbacks, "
                                              "admissions, what no phase names); null without wall_s.")
    outside_steps_frac: float | None = Field(description="The share of wall_s outside training steps.")


class StepBreakdown(BaseModel):
    """Where the training steps' time went (the phases' `steps_s`), in seconds."""

    data: float | None = Field(description="Building batches on the step's critical path (prefetch misses).")
    prefetch_overlapped: float | None = Field(description="Building batches overlapped with the device.")
    device_wait: float | None = Field(description="The host waiting for the device at each step's sync.")
    host_other: float | None = Field(description="The rest of the host's work on the critical path.")


class PackProfileOut(BaseModel):
    """A finished pack's measured profile, reported by its worker at the pack's end."""

    device: str | None
    gpus: int | None = Field(description="GPUs of a worker over several of one host; null for one.")
    steps: int | None
    first_step_s: float | None = Field(description="Seconds from the pack's start on its worker to its first "
                                                   "step's end (loading, set-up, the first step and its capture).")
    seconds: float | None = Field(description="Summed wall time of the steps.")
    tokens_per_s: float | None = Field(description="Real (non-padding) tokens per second of step time.")
    padded_fraction: float | None = Field(description="Padding's share of the batch tokens.")
    peak_memory_bytes: int | None
    shared_device: bool = Field(default=False, description="It ran beside another pack on its worker's GPU for at "
                                                           "least part of its time: its speed and peak memory "
                                                           "measured both (the planner's cost model leaves it out).")
    captured_steps: int | None = Field(description="Steps replayed from a captured CUDA graph.")
    step_breakdown_s: StepBreakdown | None
    phases: PackPhases | None
    sample_fields: list[str] | None = Field(description="The columns of each row of `samples`.")
    samples: list[list[int | float | None]] | None = Field(
        description="The pack's first steps one by one (what the planner's cost model is fitted on). Only "
                    "in GET /v1/admin/packs/{id}; null in the list.")


class PackOut(BaseModel):
    id: str
    object: Literal["pack"] = "pack"
    worker_id: str
    base_model: str
    state: str
    capacity: int = Field(description="Slots the pack was started with (its first trials' count when it takes no "
                                      "back-fills).")
    slots: list[PackSlot]
    free_slots: int
    utilisation: float = Field(ge=0, le=1, description="Occupied slots / capacity.")
    trials_placed: int = Field(description="Every trial the pack ever held, back-fills included.")
    max_rank: int | None
    target_modules: list[Any] | None
    memory_bytes: int | None = Field(default=None, description="Its predicted peak bytes (its base model and its "
                                                               "members, by the planner's cost model): what its "
                                                               "worker reserves for it beside its other packs.")
    step_s: float | None = Field(description="Mean seconds per step of the worker's latest progress report.")
    tokens_per_s: float | None = Field(description="Batch tokens (padding included) per second, from that report.")
    profile: PackProfileOut | None = Field(description="The profile its worker reported at the pack's end; null "
                                                       "before (and for a pack that failed).")
    created_at: UtcDateTime
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None


class WorkerPack(BaseModel):
    """One of a worker's live packs."""

    id: str
    base_model: str
    state: str
    used_slots: int
    memory_bytes: int | None = Field(description="What the worker reserved for it (its predicted peak bytes).")


class WorkerLoad(WorkerOut):
    """A worker (one GPU, several GPUs of one host, or the CPU) with what it runs now."""

    pack_id: str | None = Field(description="Its oldest live pack, if any (`packs` lists them all).")
    packs: list[WorkerPack] = Field(default_factory=list, description="Its live packs, oldest first: up to its "
                                                                      "max_packs, each of another base model.")
    used_slots: int
    utilisation: float = Field(ge=0, le=1, description="Occupied slots of its live packs / its max_slots.")


class TenantLoad(BaseModel):
    tenant_id: str
    name: str
    pending_trials: int
    running_trials: int
    weight: float = Field(description="Its share of the GPUs against other tenants' (the admin sets it).")
    gpu_seconds_window: float = Field(
        description="GPU seconds its trials used over the scheduler's fairness window (the last hour by default): "
                    "what preemption weighs, per unit of weight.")
    held_trials: int = Field(
        description="Of its pending trials, those paused for another tenant's waiting trials and held back until "
                    "those start (preemption).")
    waiting: list[WaitingTask] = Field(default_factory=list, description="Its tasks with trials pending, each with "
                                                                         "why they wait (the task's own `waiting`): "
                                                                         "the oldest 10 (the next to start) of "
                                                                         "`waiting_tasks`.")
    waiting_tasks: int = Field(default=0, description="All its tasks with trials pending that say why they wait "
                                                      "(`waiting` lists the oldest 10).")


class WaitingTask(BaseModel):
    task_id: str
    waiting: TaskWaiting


class ClusterOut(BaseModel):
    object: Literal["cluster"] = "cluster"
    workers_alive: int
    workers_lost: int
    workers_quarantined: int = Field(description="Alive workers in quarantine (they lost packs repeatedly): the "
                                                 "scheduler gives them no pack until their quarantined_until.")
    workers_busy: int = Field(description="Alive workers with a live pack.")
    slots_total: int = Field(description="Sum of the alive workers' max_slots.")
    slots_used: int
    utilisation: float = Field(ge=0, le=1, description="slots_used / slots_total (0 with no alive worker).")
    trials_pending: int
    trials_running: int
    workers: list[WorkerLoad] = Field(description="One page of the workers, registered first first: `limit` of "
                                                  "them (100 by default), after the worker `after` names. The "
                                                  "figures above count every worker.")
    workers_total: int = Field(description="Every registered worker, alive or lost (`workers` is a page of them).")
    has_more: bool = Field(default=False, description="More workers follow this page: ask again with `after` the "
                                                      "last one's id.")
    tenants: list[TenantLoad] = Field(description="Tenants with pending or running trials.")
