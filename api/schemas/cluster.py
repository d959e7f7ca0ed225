"""The cluster as an operator sees it: packs with their slots, and the fleet's utilisation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas.admin import WorkerOut
from api.schemas.common import UtcDateTime


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
    step_s: float | None = Field(description="Mean seconds per step of the worker's latest progress report.")
    tokens_per_s: float | None = Field(description="Batch tokens (padding included) per second, from that report.")
    created_at: UtcDateTime
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None


class WorkerLoad(WorkerOut):
    """A worker (one GPU, several GPUs of one host, or the CPU) with what it runs now."""

    pack_id: str | None = Field(description="Its live pack, if any.")
    used_slots: int
    utilisation: float = Field(ge=0, le=1, description="Occupied slots of its live pack / its max_slots.")


class TenantLoad(BaseModel):
    tenant_id: str
    name: str
    pending_trials: int
    running_trials: int


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
    workers: list[WorkerLoad]
    tenants: list[TenantLoad] = Field(description="Tenants with pending or running trials.")
