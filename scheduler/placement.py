"""The daemon's planner: the cluster snapshot as a `PlanningInput`, CP-SAT (greedy fallback), packs to start now.

Pure, no I/O. One worker is one GPU (`loraplane worker --gpu N`); a busy worker is a GPU whose pack is
predicted to end at `busy_for_s`, so the solver may choose to wait for it rather than open a worse pack now.
What a snapshot cannot know yet is estimated and said so: a trial's pooled tokens per step are its batch
size times the task's `max_seq_len` (rows are at most that long: an upper bound, so memory is
over-estimated, never under), adapter bytes are not counted until a profile has measured them (they are
inside the fitted `k0`), and step time comes from the base model's fitted profile or the cost model's priors.

Running packs are not back-filled yet (workers start a pack with its members and train it to the end): the
plan's back-fill proposals are dropped, and only new packs on idle workers start now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from scheduler.cost import (
    PRIOR_K1_BYTES_PER_TOKEN,
    PRIOR_STEP_S_PER_SLOT,
    PRIOR_STEP_S_PER_TOKEN,
    MemoryModel,
    StepTimeModel,
)
from scheduler.cpsat import plan_cpsat
from scheduler.planner import BusyWorker, IdleWorker, Plan, PlannedPack, Snapshot
from scheduler.planning import GpuSpec, ModelCost, PlanningInput, PlanResult, PlanTrial

# A GPU whose worker did not report its memory: plan as for an 80 GB H100 (the profile's fit then decides).
DEFAULT_GPU_BYTES = 80 * 2**30
# Without a profile: a fixed per-step cost for the frozen base's own work (seconds), then the cost priors.
PRIOR_STEP_BASE_S = 0.05
PRIOR_COST = ModelCost(
    memory=MemoryModel(k0_bytes=0.0, k1_bytes_per_token=PRIOR_K1_BYTES_PER_TOKEN),
    step=StepTimeModel(a_s=PRIOR_STEP_BASE_S, b_s_per_token=PRIOR_STEP_S_PER_TOKEN, c_s_per_slot=PRIOR_STEP_S_PER_SLOT),
)
UNIT_S = 1.0  # one integer time unit of the plan


@dataclass(frozen=True)
class Placement:
    plan: Plan  # new packs to record and dispatch now
    result: PlanResult | None  # the solver's whole schedule and its solve time (None: nothing to decide)


def place(snapshot: Snapshot, costs: Mapping[str, ModelCost], *, time_limit_s: float = 1.0) -> Placement:
    """Packs to start now on idle workers, chosen by CP-SAT over the whole pending set and all workers.

    Args:
        snapshot: pending trials (oldest first), idle and busy workers.
        costs: fitted cost models by base model; a model without one gets `PRIOR_COST`.
        time_limit_s: the solver's limit; at the limit the best plan found so far is taken, and the greedy
            plan when the solver found none or the model is too big to build.
    """
    if not snapshot.pending or not snapshot.idle_workers:
        return Placement(Plan(), None)
    workers: list[IdleWorker | BusyWorker] = [*snapshot.idle_workers, *snapshot.busy_workers]
    # One cap per pack for the whole cluster: the smallest worker's slots (workers of one deployment share it).
    max_slots = min(w.max_slots for w in workers)
    gpus = tuple(
        GpuSpec(gpu_id=w.worker_id, memory_bytes=w.memory_bytes or DEFAULT_GPU_BYTES) for w in snapshot.idle_workers
    ) + tuple(
        GpuSpec(gpu_id=w.worker_id, memory_bytes=w.memory_bytes or DEFAULT_GPU_BYTES,
                busy_until=max(1, math.ceil(w.busy_for_s / UNIT_S)))
        for w in snapshot.busy_workers
    )  # fmt: skip
    trials = tuple(
        PlanTrial(
            trial_id=t.trial_id,
            task_id=t.task_id,
            tenant_id=t.tenant_id,
            tenant_weight=t.tenant_weight,
            base_model=t.base_model,
            gpus_needed=1,
            tokens_per_step=t.tokens_per_step,
            remaining_steps=max(1, t.remaining_steps),
            slot_bytes=0,
            max_trials_per_pack=max(1, min(t.max_trials_per_pack, max_slots)),
        )
        for t in snapshot.pending
    )
    models = {t.base_model for t in trials}
    inp = PlanningInput(
        trials=trials, gpus=gpus, costs={m: costs.get(m, PRIOR_COST) for m in models}, unit_s=UNIT_S
    )
    result = plan_cpsat(inp, time_limit_s=time_limit_s)
    idle = {w.worker_id for w in snapshot.idle_workers}
    packs = tuple(
        PlannedPack(worker_id=p.gpu_ids[0], base_model=p.base_model, trial_ids=p.trial_ids)
        for p in result.start_now
        if not p.backfill and p.start == 0 and p.gpu_ids[0] in idle
    )
    return Placement(Plan(packs), result)
