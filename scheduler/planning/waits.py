"""Why a task's trials wait, after a plan: pure, no I/O (scheduler/service/waits.py records it on the task).

After each round's plan, every task with pending trials the plan did not start gets one `TaskWait`: a reason of a
small typed set (`WaitReason`), its place in the queue (among the tasks still waiting, in the planner's order:
submission order, as the snapshot holds them) and, when the planner predicted one, when its first waiting trial
starts. The reasons, judged in this order:

- `no_worker`: no usable worker is alive (none at all, or every one quarantined);
- `model_not_loadable`: none of them can load the task's base model (the `task.waiting_for_model` episode);
- `does_not_fit`: a worker loads the model, but none has the memory for the trial (`PlanResult.unschedulable`);
- `behind_pack`: the worker it is to start on is busy with a pack until about then (the planner's predicted start,
  or without a plan, the earliest predicted end of a pack on a worker that loads the model). When that pack is of
  the trial's model and has free slots, the message says why the trial did not join it (`not_joined`): what of the
  pack's engine cannot take it, or the cost model's reason, its members' slowdown against what the trial gains;
- `planned_later`: the plan starts it later on a worker with no pack now, or the planner has not placed it yet;
- `retry_backoff`: its trials were requeued after a failure and wait out their backoff (not in the queue yet).

The planner's times are integer units from now (`unit_s` seconds each). Whether a change is worth an event (the
reason, the position, or a start moving by more than half of the wait and more than a minute) is `worth_telling`:
an ETA that drifts round after round is not news.

No `tenant_quota` reason: the API refuses a task that would take its tenant over `max_concurrent_trials` at
submission (api/services/tasks.py), and the daemon's planner applies no quota of its own, so no trial waits for one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from scheduler.planning.coefficients import Prepared
from scheduler.planning.cost import ModelCost
from scheduler.planning.types import LivePack, LiveWorker, PendingTrial, PlanResult, Snapshot, planning_input

WaitReason = Literal["no_worker", "model_not_loadable", "does_not_fit", "behind_pack", "planned_later",
                     "retry_backoff"]
WAIT_REASONS: tuple[WaitReason, ...] = ("no_worker", "model_not_loadable", "does_not_fit", "behind_pack",
                                        "planned_later", "retry_backoff")
ETA_MOVE_FRACTION = 0.5  # a new event when the predicted start moves by more than this share of the wait...
ETA_MOVE_MIN_S = 60.0  # ...and by more than this many seconds...
# ...and at most once in this long: a start predicted behind an overrunning pack can flip between two estimates
# each round (measured: 55,505 task.waiting events in 21 minutes of the quality benchmark on an H200, 2026-11-27,
# one task flipping between "under a minute" and "about 2 min" twice a second).
ETA_RETELL_S = 300.0


@dataclass(frozen=True)
class BusyPack:
    """A live pack (planned, dispatched or running) on a worker: what a waiting trial may be behind."""

    pack_id: str
    worker_id: str
    base_model: str
    trials: int  # its running members
    ends_in_s: float  # predicted seconds until its members are done


@dataclass(frozen=True)
class Backoff:
    """A task whose pending trials all wait out a requeue backoff (they are not in the snapshot)."""

    task_id: str
    tenant_id: str
    base_model: str
    trials: int
    ends_in_s: float  # until the first of them may be placed again


@dataclass(frozen=True)
class TaskWait:
    task_id: str
    tenant_id: str
    base_model: str
    reason: WaitReason
    waiting_trials: int  # its pending trials this plan did not start
    position: int | None  # 1 = first among the waiting tasks; None: not in the queue (its backoff)
    starts_in_s: float | None  # predicted; None: nothing to predict it from
    message: str
    pack_id: str | None = None  # `behind_pack`: the pack, its worker
    worker_id: str | None = None


def task_waits(pending: Sequence[PendingTrial], started: Set[str], workers: Sequence[LiveWorker],
               packs: Sequence[BusyPack], result: PlanResult | None, *, unit_s: float,
               unjudged_models: Set[str] = frozenset(), backoffs: Sequence[Backoff] = (),
               live_packs: Sequence[LivePack] = (), costs: Mapping[str, ModelCost] | None = None) -> list[TaskWait]:
    """Each task of ``pending`` (the snapshot's, in the planner's order) with trials not in ``started`` (what
    the plan starts now), why they wait, in queue order; then the tasks of ``backoffs``.

    Args:
        workers: the usable workers (idle and busy); packs: their live packs, those this plan starts included.
        result: the solver's schedule (None: the planner did not run, or had nothing to decide).
        unjudged_models: models registered too recently to say no worker loads them (the workers' heartbeats may
            predate them): their tasks are not told `model_not_loadable` yet.
        live_packs: the snapshot's running packs with free slots; costs: the cost models the planner used (None: it
            did not run). With them a `behind_pack` message says why the trial did not join the pack (`not_joined`).
    """
    waiting: dict[str, list[PendingTrial]] = {}
    for trial in pending:
        if trial.trial_id not in started:
            waiting.setdefault(trial.task_id, []).append(trial)
    scheduled = {tid: (p.start, p.worker_ids[0]) for p in result.packs for tid in p.trial_ids} if result else {}
    unschedulable = set(result.unschedulable) if result else set()
    by_worker = {p.worker_id: p for p in packs}
    with_room = {p.pack_id: p for p in live_packs}
    worker_of = {w.worker_id: w for w in workers}
    out = []
    for position, trials in enumerate(waiting.values(), start=1):
        first = trials[0]
        reason, starts_in_s, pack = _why(first.base_model, [t.trial_id for t in trials], workers, by_worker,
                                         scheduled, unschedulable, unit_s, unjudged_models)
        room = with_room.get(pack.pack_id) if pack is not None else None
        why_not = None
        if room is not None and room.base_model == first.base_model:
            planned_end = result.completion.get(first.trial_id) if result else None
            why_not = not_joined(first, room, worker_of.get(room.worker_id), (costs or {}).get(room.base_model),
                                 unit_s=unit_s, planned_end_s=None if planned_end is None else planned_end * unit_s)
        out.append(_wait(first, len(trials), reason, position, starts_in_s, pack, len(workers), why_not))
    for held in backoffs:
        out.append(TaskWait(
            task_id=held.task_id, tenant_id=held.tenant_id, base_model=held.base_model, reason="retry_backoff",
            waiting_trials=held.trials, position=None, starts_in_s=max(0.0, held.ends_in_s),
            message=f"{_trials(held.trials)} requeued after a failure, waiting out the retry backoff; back in the "
                    f"queue in {_about(held.ends_in_s)}"))
    return out


def _why(model: str, trial_ids: list[str], workers: Sequence[LiveWorker], by_worker: Mapping[str, BusyPack],
         scheduled: Mapping[str, tuple[int, str]], unschedulable: Set[str], unit_s: float,
         unjudged_models: Set[str]) -> tuple[WaitReason, float | None, BusyPack | None]:
    """The reason, the predicted seconds until the first trial starts, and the pack it waits behind."""
    if not workers:
        return "no_worker", None, None
    loaders = [w for w in workers if w.can_load(model)]
    if not loaders and model not in unjudged_models:
        return "model_not_loadable", None, None
    planned = sorted(scheduled[t] for t in trial_ids if t in scheduled)
    if planned:
        start, worker_id = planned[0]
        behind = by_worker.get(worker_id)
        return ("behind_pack" if behind else "planned_later"), start * unit_s, behind
    if loaders and all(t in unschedulable for t in trial_ids):
        return "does_not_fit", None, None
    # No prediction (the planner had nothing to decide: no idle worker loads the model, no pack can take the
    # trials): the pack on a worker that loads the model that is predicted to end first.
    ends = sorted((p.ends_in_s, p.pack_id) for w in loaders if (p := by_worker.get(w.worker_id)) is not None)
    if ends and len(ends) == len(loaders):
        behind = next(p for p in by_worker.values() if p.pack_id == ends[0][1])
        return "behind_pack", max(0.0, behind.ends_in_s), behind
    return "planned_later", None, None  # a worker that loads it is free: the planner places it at a next round


@dataclass(frozen=True)
class JoinCost:
    """What joining a running pack now would cost its members and gain the trial, by the planner's cost model (the
    integer arithmetic every planner shares, coefficients.py), in seconds."""

    members_slowed_s: float  # the members' completions delayed, summed
    members_slowed_weighted_s: float  # the same, each member's delay times its tenant's weight (the objective's)
    joined_end_s: float  # the trial's completion inside the pack, from now
    fits_memory: bool  # the worker's memory left beside the pack holds the trial


def join_cost(trial: PendingTrial, pack: LivePack, worker: LiveWorker | None, cost: ModelCost, *,
              unit_s: float) -> JoinCost | None:
    """The cost of back-filling ``trial`` into ``pack`` now; None when the planner could not weigh it (no model of
    the pack's members, or a trial it cannot place at all)."""
    if not pack.member_list:
        return None
    busy = (_busy_until_end(worker, pack),) if worker is not None else ()
    inp = planning_input(Snapshot(pending=(trial,), idle_workers=(), busy_workers=busy, live_packs=(pack,)),
                         {pack.base_model: cost}, unit_s=unit_s)
    prep = Prepared(inp)
    if not prep.trials:
        return None
    running, joining = inp.running[0], prep.trials[0]
    _, alone, _ = prep.pack_times(0, [], running)
    mine, slowed, _ = prep.pack_times(0, [joining], running)
    room = prep.worker_mem.get(pack.worker_id)
    fits = room is None or prep.mem_running(running) + prep.mem_item(joining) <= room
    weight = {m.trial_id: m.tenant_weight for m in running.members}
    return JoinCost(members_slowed_s=sum(slowed[i] - alone[i] for i in alone) * unit_s,
                    members_slowed_weighted_s=sum(weight[i] * (slowed[i] - alone[i]) for i in alone) * unit_s,
                    joined_end_s=mine[joining.trial_id] * unit_s, fits_memory=fits)


def _busy_until_end(worker: LiveWorker, pack: LivePack) -> LiveWorker:
    """The pack's worker as busy until the pack's end (the planner's view of it; only its memory matters here)."""
    return LiveWorker(worker.worker_id, worker.max_slots, worker.memory_bytes, worker.models,
                      busy_for_s=max(pack.busy_for_s, 1.0), gpus=worker.gpus, warm=worker.warm)


def not_joined(trial: PendingTrial, pack: LivePack, worker: LiveWorker | None, cost: ModelCost | None, *,
               unit_s: float, planned_end_s: float | None) -> str | None:
    """Why ``trial`` waits behind ``pack`` (its model, with free slots) rather than joining it, in words; None when
    neither the pack's engine nor the cost model says (the plan's other constraints: quotas, other trials' turns).

    A back-fill is weighed like every placement: the objective sums each trial's (weighted) completion time, and a
    trial that joins trains its tokens in every step of the pack, so each member's remaining steps get slower. When
    the members' summed slowdown is more than the trial gains by starting now, waiting for the pack's end costs less:
    the planner's choice, which the message states with both numbers."""
    slots = f"pack has {pack.free_slots} free slot{'' if pack.free_slots == 1 else 's'}"
    if trial.lora_rank > pack.max_rank:
        return f"the {slots}, but its adapters are padded to rank {pack.max_rank}, below this trial's {trial.lora_rank}"
    if not pack.fits(trial) and pack.members >= trial.max_trials_per_pack:
        return (f"the {slots}, but the task lets at most {trial.max_trials_per_pack} trials share a pack "
                f"and it trains {pack.members}")
    if not pack.fits(trial):
        return f"the {slots}, but it does not wrap the layers this trial adapts ({', '.join(trial.target_modules)})"
    weighed = join_cost(trial, pack, worker, cost, unit_s=unit_s) if cost is not None else None
    if weighed is None:
        return None
    if not weighed.fits_memory:
        return f"the {slots}, but the worker's memory left beside it cannot hold this trial"
    if planned_end_s is None:
        return None
    gain_s = planned_end_s - weighed.joined_end_s
    if weighed.members_slowed_weighted_s <= trial.tenant_weight * gain_s:
        return None  # the cost model alone would have it join: something else held it back
    members = _trials(len(pack.member_list))
    weighted = any(m.tenant_weight != trial.tenant_weight for m in pack.member_list)
    return (f"the {slots}, but joining now would slow its {members} by {_about(weighed.members_slowed_s)} in all "
            f"(each step trains every member's tokens), while this trial would end {_about(max(0.0, gain_s))} "
            f"sooner{' (each weighed by its tenant)' if weighted else ''}: waiting costs less in the planner's cost "
            "model")


def _wait(first: PendingTrial, n: int, reason: WaitReason, position: int, starts_in_s: float | None,
          pack: BusyPack | None, workers: int, why_not: str | None = None) -> TaskWait:
    model = first.base_model
    what = {
        "no_worker": "no usable worker is alive (none, or every one quarantined)",
        "model_not_loadable": f"no live worker can load model {model} ({workers} worker(s) alive)",
        "does_not_fit": f"no worker that loads model {model} has the memory for them",
        "planned_later": "the planner starts them later" if starts_in_s is not None
        else "a worker that loads the model is free: the planner places them at its next round",
    }
    if pack is not None:
        text = (f"waiting behind pack {pack.pack_id} on worker {pack.worker_id} ({_trials(pack.trials)} of "
                f"{pack.base_model}, {_about(pack.ends_in_s)} left)")
        if why_not is not None:
            text += f": {why_not}"
    else:
        text = f"waiting: {what[reason]}"
    starts = f"; starts in {_about(starts_in_s)}" if starts_in_s is not None else ""
    return TaskWait(task_id=first.task_id, tenant_id=first.tenant_id, base_model=model, reason=reason,
                    waiting_trials=n, position=position, starts_in_s=starts_in_s,
                    message=f"{_trials(n)} {text}; {_ordinal(position)} in queue{starts}",
                    pack_id=pack.pack_id if pack else None, worker_id=pack.worker_id if pack else None)


def start_at(wait: TaskWait, now: datetime) -> datetime | None:
    """The predicted start as a time (to the second)."""
    if wait.starts_in_s is None:
        return None
    return (now + timedelta(seconds=wait.starts_in_s)).replace(microsecond=0)


def worth_telling(told: tuple[str, int | None, datetime | None, datetime | None] | None, wait: TaskWait,
                  now: datetime) -> bool:
    """Whether ``wait`` is news against what the task was last told, ``told`` = (reason, position, predicted
    start, when it was told; None for a record from before that was kept) or None: a new reason or position, a
    start newly known or no longer known, or a start that moved by more than `ETA_MOVE_FRACTION` of the wait then
    announced and by more than `ETA_MOVE_MIN_S`, at most once every `ETA_RETELL_S`."""
    if told is None:
        return True
    reason, position, at, told_at = told
    new_at = start_at(wait, now)
    if (reason, position) != (wait.reason, wait.position) or (at is None) != (new_at is None):
        return True
    if at is None or new_at is None:
        return False
    if told_at is not None and (now - told_at).total_seconds() < ETA_RETELL_S:
        return False
    moved = abs((new_at - at).total_seconds())
    announced_wait = max(0.0, (at - (told_at or now)).total_seconds())
    return moved > ETA_MOVE_MIN_S and moved > ETA_MOVE_FRACTION * announced_wait


def _trials(n: int) -> str:
    return f"{n} trial" + ("" if n == 1 else "s")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _about(seconds: float) -> str:
    """A duration as people say it: "under a minute", "about 3 min", "about 1.5 h"."""
    if seconds < 60:
        return "under a minute"
    if seconds < 3600:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.1f} h"
