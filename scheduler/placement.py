"""The daemon's planner: the cluster snapshot as a `PlanningInput`, CP-SAT (greedy fallback), packs to start now.

Pure, no I/O. One worker is one GPU (`loraplane worker --gpu N`); a busy worker is a GPU whose pack is
predicted to end at `busy_for_s`, so the solver may choose to wait for it rather than open a worse pack now.
A worker that names the models it can load (`IdleWorker.models`) gets packs of those models only; a trial
whose model no worker can load is left out of the plan (`PlanResult.unschedulable`) and stays pending.
What a snapshot cannot know yet is estimated and said so: a trial's pooled tokens per step are its batch
size times the task's `max_seq_len` (rows are at most that long: an upper bound, so memory is
over-estimated, never under), adapter bytes are not counted until a profile has measured them (they are
inside the fitted `k0`), and step time comes from the base model's fitted profile or the cost model's priors.

Running packs with free slots are offered to the solver as such: it may back-fill a pending trial into one
(the trial joins at the pack's next step) when the pack's engine can take it (`LivePack.fits`: its base
model, a rank within its padding, targets among its wrapped layers); a proposal it cannot take is dropped
and the trial stays pending. A new pack is given room to grow: its capacity is the worker's slots (capped by
its members' `max_trials_per_pack`), and its rank padding and wrapped layers cover its members and every
pending trial of its base model, so that those can be back-filled later.

One rule comes before the solver: a resumed trial (one kept by its task's warm-up ranking after it paused
at its boundary, or one requeued from a checkpoint) rejoins a running pack of its own task that has room
(`rejoin`). The solver would weigh that back-fill against the members it slows and, with a per-token step
cost, prefer to wait for the pack to end (shortest work first); but the pack ran with this trial in it a
moment ago, and on a GPU not saturated by the pack (small models, where a step's fixed cost dominates)
waiting doubled a task's wall-clock time in the live early-exit sweep (benchmarks/live_sweep.py). One rule
comes after it: no worker free now is left idle while the plan holds a pack for later
(`planning.work_conserving`: the earliest such pack starts now on it, within memory and quotas). And for a base
model no pack has measured yet (its plan rests on the cost priors), no trial is held for a later pack while a
pack of its model starting now has room (`planning.fill_now`): with a prior step time the objective cannot tell
whether a bigger pack pays, and a held-back trial made an early-exit task slower than one without (issue 15).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from scheduler.cpsat import plan_cpsat
from scheduler.planner import Backfill, BusyWorker, IdleWorker, PendingTrial, Plan, PlannedPack, Snapshot
from scheduler.planning import (
    DEFAULT_GPU_BYTES,
    PRIOR_COST,
    GpuSpec,
    ModelCost,
    PlanningInput,
    PlanResult,
    PlanTrial,
    RunningPack,
    fill_now,
    work_conserving,
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
    rejoins, snapshot = rejoin(snapshot)
    live = [p for p in snapshot.live_packs if p.free_slots > 0 and any(p.fits(t) for t in snapshot.pending)]
    if not snapshot.pending or not (snapshot.idle_workers or live):
        return Placement(Plan(backfills=rejoins), None)
    workers: list[IdleWorker | BusyWorker] = [*snapshot.idle_workers, *snapshot.busy_workers]
    # One cap per pack for the whole cluster: the smallest worker's slots (workers of one deployment share it).
    max_slots = min(w.max_slots for w in workers)
    gpus = tuple(
        GpuSpec(gpu_id=w.worker_id, memory_bytes=w.memory_bytes or DEFAULT_GPU_BYTES, models=w.models)
        for w in snapshot.idle_workers
    ) + tuple(
        GpuSpec(gpu_id=w.worker_id, memory_bytes=w.memory_bytes or DEFAULT_GPU_BYTES,
                busy_until=max(1, math.ceil(w.busy_for_s / UNIT_S)), models=w.models)
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
    running = tuple(
        RunningPack(
            pack_id=p.pack_id, gpu_ids=(p.worker_id,), base_model=p.base_model,
            ends_at=max(1, math.ceil(p.busy_for_s / UNIT_S)), trials=p.members, free_slots=p.free_slots,
            tokens_per_step=p.tokens_per_step, slot_bytes=0, max_trials_per_pack=p.members + p.free_slots,
            # Member by member: a back-fill then pays in the objective for the members it slows.
            members=p.member_list,
        )
        for p in live
    )  # fmt: skip
    models = {t.base_model for t in trials}
    inp = PlanningInput(
        trials=trials, gpus=gpus, costs={m: costs.get(m, PRIOR_COST) for m in models}, running=running,
        unit_s=UNIT_S,
    )
    # The solver may hold a free worker back for a later pack (its cost model sees no gain in starting now);
    # in a live run on the H100 a worker stood idle for minutes with trials pending: none idles while a pack waits.
    result = work_conserving(inp, plan_cpsat(inp, time_limit_s=time_limit_s))
    # On the priors alone, no trial waits for a later pack while a pack of its model starting now has room.
    result = fill_now(inp, result, models - costs.keys())
    idle = {w.worker_id: w for w in snapshot.idle_workers}
    pending = {t.trial_id: t for t in snapshot.pending}
    packs = tuple(
        _new_pack(idle[p.gpu_ids[0]], p.base_model, [pending[i] for i in p.trial_ids], snapshot.pending)
        for p in result.start_now
        if not p.backfill and p.start == 0 and p.gpu_ids[0] in idle
    )
    by_id = {p.pack_id: p for p in live}
    backfills = []
    for proposal in result.start_now:
        pack = by_id.get(proposal.pack_key) if proposal.backfill else None
        if pack is None:
            continue
        joining = tuple(i for i in proposal.trial_ids if pack.fits(pending[i]))[: pack.free_slots]
        if joining:
            backfills.append(Backfill(pack.pack_id, pack.worker_id, joining))
    return Placement(Plan(packs, rejoins + tuple(backfills)), result)


def rejoin(snapshot: Snapshot) -> tuple[tuple[Backfill, ...], Snapshot]:
    """Back-fills of resumed trials into running packs of their own tasks (first fit, oldest trial first),
    and the snapshot left for the solver: those trials no longer pending, those slots no longer free."""
    room = {p.pack_id: p.free_slots for p in snapshot.live_packs}
    joining: dict[str, list[str]] = {}
    for trial in snapshot.pending:
        if not trial.resumed:
            continue
        pack = next((p for p in snapshot.live_packs
                     if trial.task_id in p.task_ids and room[p.pack_id] > 0 and p.fits(trial)), None)
        if pack is not None:
            room[pack.pack_id] -= 1
            joining.setdefault(pack.pack_id, []).append(trial.trial_id)
    if not joining:
        return (), snapshot
    joined = {tid for ids in joining.values() for tid in ids}
    by_id = {p.pack_id: p for p in snapshot.live_packs}
    backfills = tuple(Backfill(pid, by_id[pid].worker_id, tuple(ids)) for pid, ids in joining.items())
    left = replace(snapshot, pending=tuple(t for t in snapshot.pending if t.trial_id not in joined),
                   live_packs=tuple(replace(p, free_slots=room[p.pack_id]) for p in snapshot.live_packs))
    return backfills, left


def _new_pack(
    worker: IdleWorker, model: str, members: list[PendingTrial], pending: tuple[PendingTrial, ...]
) -> PlannedPack:
    """A pack of ``members`` on ``worker``, shaped to take later back-fills of the same base model."""
    same_model = [t for t in pending if t.base_model == model]
    capacity = min(worker.max_slots, *(t.max_trials_per_pack for t in members))
    targets = sorted({pattern for t in same_model for pattern in t.target_modules})
    return PlannedPack(
        worker_id=worker.worker_id, base_model=model, trial_ids=tuple(t.trial_id for t in members),
        capacity=max(capacity, len(members)), max_rank=max(t.lora_rank for t in same_model),
        target_modules=tuple(targets),
    )
