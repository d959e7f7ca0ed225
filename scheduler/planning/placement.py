"""The daemon's planner: the cluster snapshot as a `PlanningInput`, CP-SAT (greedy fallback), packs to start now.

Pure, no I/O. One worker is one planning unit (one `WorkerSpec`), whether it owns one GPU (`loraplane worker --gpu N`)
or several of one host (`--gpus 0,1`: it runs one pack at a time over all of them, with all of their memory); a
busy worker is a unit whose pack is predicted to end at `busy_for_s`, so the solver may choose to wait for it
rather than open a worse pack now. A worker that may run another pack beside its running ones (worker/colocation.py,
`LORAPLANE_WORKER_MAX_PACKS` above 1) is also a unit of its own, idle, with the memory they left (`types.unit_id`).
A worker that names the models it can load (`LiveWorker.models`) gets packs of those models only; a trial
whose model no worker can load is left out of the plan (`PlanResult.unschedulable`) and stays pending.
What a snapshot cannot know yet is estimated and said so: a trial's pooled tokens per step are its batch
size times the task's `max_seq_len` (rows are at most that long: an upper bound, so memory is
over-estimated, never under), adapter bytes are not counted until a profile has measured them (they are
inside the fitted `k0`), and step time comes from the base model's fitted profile or the cost model's priors
(memory too: the priors count a model's frozen weights when its size is known, `cost.prior_cost`).

Running packs with free slots are offered to the solver as such: it may back-fill a pending trial into one
(the trial joins at the pack's next step) when the pack's engine can take it (`LivePack.fits`: its base
model, a rank within its padding, targets among its wrapped layers); a proposal it cannot take is dropped
and the trial stays pending. A new pack is given room to grow: its `max_trials_per_pack` is its members' lowered
to the worker's slots (`types.lower_to_slots`), and its rank padding and wrapped layers cover its members and
every pending trial of its base model, so that those can be back-filled later.

One rule comes before the solver: a resumed trial (one kept by its task's warm-up ranking after it paused
at its boundary, or one requeued from a checkpoint) rejoins a running pack of its own task that has room
(`rejoin`). The solver would weigh that back-fill against the members it slows and, with a per-token step
cost, prefer to wait for the pack to end (shortest work first); but the pack ran with this trial in it a
moment ago, and on a GPU not saturated by the pack (small models, where a step's fixed cost dominates)
waiting doubled a task's wall-clock time in the live early-exit sweep (benchmarks/live_sweep.py). One rule
comes after it: no worker free now is left idle while the plan holds a pack for later
(`rules.work_conserving`: the earliest such pack starts now on it, within memory and quotas). And for a base
model no pack has measured yet (its plan rests on the cost priors), no trial is held for a later pack while a
pack of its model starting now has room (`rules.fill_now`): with a prior step time the objective cannot tell
whether a bigger pack pays, and a held-back trial made an early-exit task slower than one without (issue 15).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from scheduler.planning.cost import ModelCost
from scheduler.planning.cpsat import plan_cpsat
from scheduler.planning.greedy import plan_greedy
from scheduler.planning.rules import after_solver
from scheduler.planning.types import (
    Backfill,
    LivePack,
    LiveWorker,
    PendingTrial,
    Plan,
    PlannedPack,
    PlanResult,
    Snapshot,
    lower_to_slots,
    planning_input,
    unit_id,
)

UNIT_S = 1.0  # one integer time unit of the plan
Solver = Literal["cpsat", "greedy"]  # `LORAPLANE_PLANNER`


@dataclass(frozen=True)
class Placement:
    plan: Plan  # new packs to record and dispatch now
    result: PlanResult | None  # the solver's whole schedule and its solve time (None: nothing to decide)


def place(snapshot: Snapshot, costs: Mapping[str, ModelCost], *, solver: Solver = "cpsat",
          time_limit_s: float = 1.0) -> Placement:
    """Packs to start now on idle workers, chosen over the whole pending set and all workers.

    Args:
        snapshot: pending trials (oldest first), idle and busy workers, running packs with room.
        costs: cost models by base model, fitted or the priors (`ModelCost.prior`: cluster_state.load_costs gives
            every registered model one); a model without one gets `PRIOR_COST`.
        solver: "cpsat" (the default), or "greedy": the first-fit planner alone, which is also CP-SAT's hint and
            fallback. The rules before and after the solver are the same for both.
        time_limit_s: CP-SAT's limit; at the limit the best plan found so far is taken, and the greedy plan when
            the solver found none or the model is too big to build.
    """
    rejoins, snapshot = rejoin(snapshot)
    live = [p for p in snapshot.live_packs if p.free_slots > 0 and any(p.fits(t) for t in snapshot.pending)]
    if not snapshot.pending or not (snapshot.idle_workers or live):
        return Placement(Plan(backfills=rejoins), None)
    inp = planning_input(replace(snapshot, live_packs=tuple(live)), costs, unit_s=UNIT_S)
    if solver == "cpsat":
        solved = plan_cpsat(inp, time_limit_s=time_limit_s)
    else:  # the first-fit plan by choice, not as CP-SAT's fallback
        solved = replace(plan_greedy(inp), status="greedy")
    # The solver may hold a free worker back for a later pack (its cost model sees no gain in starting now);
    # in a live run on the H100 a worker stood idle for minutes with trials pending: none idles while a pack waits.
    # On the priors alone, no trial waits for a later pack while a pack of its model starting now has room.
    result = after_solver(inp, solved, on_priors={model for model, cost in inp.costs.items() if cost.prior})
    packs = _new_packs(snapshot, result)
    # A worker that takes a pack beside its running one this round gives that one no back-fill in it: the room beside
    # was what the running pack left, and its back-fills would take some of it.
    beside = {w.worker_id for w in snapshot.idle_workers if w.beside_packs} & {p.worker_id for p in packs}
    backfills = tuple(b for b in _backfills(live, snapshot, result) if b.worker_id not in beside)
    return Placement(Plan(packs, rejoins + backfills), result)


def _new_packs(snapshot: Snapshot, result: PlanResult) -> tuple[PlannedPack, ...]:
    """The plan's new packs that start now on idle workers (the room beside a worker's packs: on that worker)."""
    idle = {unit_id(w): w for w in snapshot.idle_workers}
    pending = {t.trial_id: t for t in snapshot.pending}
    return tuple(
        _new_pack(idle[p.worker_ids[0]], p.base_model, [pending[i] for i in p.trial_ids], snapshot.pending)
        for p in result.start_now
        if not p.backfill and p.start == 0 and p.worker_ids[0] in idle
    )


def _backfills(live: list[LivePack], snapshot: Snapshot, result: PlanResult) -> tuple[Backfill, ...]:
    """The plan's back-fills that the running packs' engines can take (`LivePack.fits`), within their free slots."""
    by_id = {p.pack_id: p for p in live}
    pending = {t.trial_id: t for t in snapshot.pending}
    backfills = []
    for proposal in result.start_now:
        pack = by_id.get(proposal.pack_key) if proposal.backfill else None
        if pack is None:
            continue
        joining = tuple(i for i in proposal.trial_ids if pack.fits(pending[i]))[: pack.free_slots]
        if joining:
            backfills.append(Backfill(pack.pack_id, pack.worker_id, joining))
    return tuple(backfills)


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
    worker: LiveWorker, model: str, members: list[PendingTrial], pending: tuple[PendingTrial, ...]
) -> PlannedPack:
    """A pack of ``members`` on ``worker``, shaped to take later back-fills of the same base model."""
    same_model = [t for t in pending if t.base_model == model]
    max_trials_per_pack = lower_to_slots(min(t.max_trials_per_pack for t in members), [worker.max_slots])
    targets = sorted({pattern for t in same_model for pattern in t.target_modules})
    return PlannedPack(
        worker_id=worker.worker_id, base_model=model, trial_ids=tuple(t.trial_id for t in members),
        max_trials_per_pack=max(max_trials_per_pack, len(members)), max_rank=max(t.lora_rank for t in same_model),
        target_modules=tuple(targets),
    )
