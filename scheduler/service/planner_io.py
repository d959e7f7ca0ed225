"""The planner's side of the database, each function inside the caller's transaction (scheduler/service/daemon.py
sequences them): the snapshot it plans from (pending trials, idle workers, running packs with room), the plan it
records (new packs, back-fills), and the admissions and stops owed to running packs. What the planner reads of
the cluster's workers and costs is in scheduler/service/cluster_state.py; a task's end in task_results.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from common import states
from common.events import record_event
from common.tables import BaseModelEntry, Event, Pack, Task, Tenant, Trial, Worker, as_utc, new_id
from scheduler.planning.cost import PRIOR_COST, ModelCost
from scheduler.planning.faults import max_trials_per_pack_after_losses
from scheduler.planning.types import (
    DEFAULT_GPU_BYTES,
    LivePack,
    LiveWorker,
    PendingTrial,
    Plan,
    PlanResult,
    RunningMember,
    Snapshot,
    loads,
)
from scheduler.service.cluster_state import (
    MembersRead,
    alive_workers,
    pack_memory,
    predicted_remaining_s,
    quarantined_worker_ids,
    running_members,
    trial_tokens_per_step,
    usable_workers,
    worker_models,
    worker_warm,
)
from scheduler.service.cluster_state import busy_workers as busy_workers
from scheduler.service.cluster_state import load_costs as load_costs
from scheduler.service.exits import stop_mode

log = logging.getLogger(__name__)


def _target_patterns(trial: Trial) -> tuple[str, ...]:
    targets = trial.hyperparameters.get("target_modules", "all-linear")
    return (targets,) if isinstance(targets, str) else tuple(sorted(targets))


def build_snapshot(session: Session, now: datetime, timeout_s: float) -> Snapshot:
    """Pending trials (locked for this transaction) that may be placed now (their requeue backoff is over) and idle
    workers out of quarantine; `busy_workers` fills in the rest."""
    busy_ids = set(session.scalars(select(Pack.worker_id).where(Pack.state.in_(states.PACK_LIVE))).all())
    workers = usable_workers(session, now, timeout_s)
    rows = session.execute(
        select(Trial, Tenant.weight)
        .join(Task, Task.id == Trial.task_id)
        .join(Tenant, Tenant.id == Task.tenant_id)
        .where(Trial.state == states.TRIAL_PENDING,
               Task.state.in_((states.TASK_QUEUED, states.TASK_RUNNING)),
               or_(Trial.not_before.is_(None), Trial.not_before <= now))
        .order_by(Task.created_at, Task.id, Trial.index)
        # record_plan moves these trials to running in this transaction: lock them so a concurrent cancel
        # either waits for us (and the stop command follows) or makes us skip them.
        .with_for_update(of=Trial, skip_locked=True, key_share=True)
    ).all()
    # Each task read once, not with each of its trials' rows (its spec is JSON, decoded per row read).
    tasks = {task.id: task for task in session.scalars(select(Task).where(Task.id.in_({t.task_id for t, _ in rows})))}
    pending = tuple(_pending_trial(trial, tasks[trial.task_id], weight) for trial, weight in rows)
    idle = tuple(LiveWorker(w.id, w.max_slots, pack_memory(w), worker_models(w), gpus=w.gpus, warm=worker_warm(w))
                 for w in workers if w.id not in busy_ids)
    models = {t.base_model for t in pending}
    sharing = tuple(room for w in workers if w.id in busy_ids and w.max_packs > 1 and w.gpus == 1
                    if (room := room_beside_packs(session, w, models)) is not None)
    return Snapshot(pending=pending, idle_workers=idle + sharing)


def _pending_trial(trial: Trial, task: Task, weight: float | None) -> PendingTrial:
    return PendingTrial(
        trial_id=trial.id,
        task_id=task.id,
        tenant_id=task.tenant_id,
        base_model=task.base_model,
        max_trials_per_pack=max_trials_per_pack_after_losses(task.parsed_spec.scheduling.max_trials_per_pack,
                                                             trial.worker_losses),
        remaining_steps=max(1, trial.total_steps - (trial.checkpoint_step or 0)),
        tokens_per_step=trial_tokens_per_step(trial, task),
        # The objective's weights are integers: a tenant's weight rounds to the nearest, at least 1.
        tenant_weight=max(1, round(weight or 1.0)),
        lora_rank=int(trial.hyperparameters.get("lora_rank", 8)),
        target_modules=_target_patterns(trial),
        resumed=(trial.checkpoint_step or 0) > 0,
    )


def room_beside_packs(session: Session, worker: Worker, models: set[str]) -> LiveWorker | None:
    """A worker that runs packs but may run one more (worker/colocation.py), as the planners see it besides the busy
    worker it also is (`busy_workers`): an idle planning unit of its own (`types.unit_id`) whose memory is what its
    packs left (its memory less their planned bytes, and no more than its beats say is
    free), that loads only the models ``models`` of the pending trials that none of its packs runs (a second pack of
    one model would wrap the layers the first one's engine holds: such trials join that pack as back-fills). None
    where it runs its most packs already, a pack of unknown size, or nothing could go beside them."""
    live = session.scalars(select(Pack).where(Pack.worker_id == worker.id, Pack.state.in_(states.PACK_LIVE))).all()
    if worker.gpus > 1 or len(live) >= worker.max_packs or any(p.memory_bytes is None for p in live):
        return None
    spare = (pack_memory(worker) or DEFAULT_GPU_BYTES) - sum(p.memory_bytes or 0 for p in live)
    if worker.free_memory_bytes is not None:
        spare = min(spare, worker.free_memory_bytes)
    loadable = {m for m in models if loads(worker_models(worker), m)} - {p.base_model for p in live}
    if spare <= 0 or not loadable:
        return None
    return LiveWorker(worker.id, worker.max_slots, spare, frozenset(loadable), warm=worker_warm(worker),
                      beside_packs=True)


WAITING_FOR_MODEL = "task.waiting_for_model"
MODEL_AVAILABLE = "task.model_available"


def note_model_waits(session: Session, pending: Sequence[PendingTrial], now: datetime, timeout_s: float) -> None:
    """Tells each task with pending trials whose base model no live worker can load, once, that it waits for
    one (`task.waiting_for_model`), and tells it again when a live worker can load its model
    (`task.model_available`); its trials stay pending meanwhile (the planners place a model's trials only on
    workers that load it). Nothing is said while no worker is alive at all: there is no one to judge by.

    Once per episode, not once per replan: whether the task was already told is read back from its own
    events (the newer of the two kinds), so it holds across scheduler restarts and needs no column. Costs
    one query of the live workers and one of those events (indexed by task) per round with pending trials.

    A model registered (or edited) within the last `timeout_s` is not judged yet: the workers' heartbeats may
    predate it (each checks the registry it read, every few seconds), and a fresh model's first task would be
    told it waits for nothing."""
    if not pending:
        return
    workers = alive_workers(session, now, timeout_s)
    if not workers:
        return
    tasks: dict[str, tuple[str, str]] = {}  # task -> (tenant, base model)
    for t in pending:
        tasks.setdefault(t.task_id, (t.tenant_id, t.base_model))
    loadable = {model: any(loads(worker_models(w), model) for w in workers) for _, model in tasks.values()}
    for name in unjudged_models(session, [m for m, ok in loadable.items() if not ok], now, timeout_s):
        del loadable[name]  # too new to judge: the workers may not have checked it yet
    told: dict[str, str] = {}  # the newest of the two kinds per task (rows in id order: the last one wins)
    for task_id, kind in session.execute(
        select(Event.task_id, Event.type)
        .where(Event.task_id.in_(list(tasks)), Event.type.in_((WAITING_FOR_MODEL, MODEL_AVAILABLE)))
        .order_by(Event.id)
    ):
        told[task_id] = kind
    for task_id, (tenant_id, model) in tasks.items():
        if model not in loadable:
            continue
        waiting = told.get(task_id) == WAITING_FOR_MODEL
        if not loadable[model] and not waiting:
            record_event(
                session, tenant_id=tenant_id, task_id=task_id, type=WAITING_FOR_MODEL, level="warn",
                message=f"no live worker can load model {model} ({len(workers)} worker(s) alive); the task waits "
                        "until one can",
                data={"base_model": model, "workers_alive": len(workers)},
            )
        elif loadable[model] and waiting:
            able = sorted(w.id for w in workers if loads(worker_models(w), model))
            record_event(
                session, tenant_id=tenant_id, task_id=task_id, type=MODEL_AVAILABLE,
                message=f"worker {able[0]} can load model {model}: the task's trials can be placed"
                        + (f" (and {len(able) - 1} more)" if len(able) > 1 else ""),
                data={"base_model": model, "workers": able},
            )


def unjudged_models(session: Session, models: Sequence[str], now: datetime, timeout_s: float) -> set[str]:
    """Those of ``models`` registered (or edited) within the last ``timeout_s``: too new to say that no worker
    can load them (the workers' heartbeats may predate them; each checks the registry every few seconds)."""
    if not models:
        return set()
    recent = now - timedelta(seconds=timeout_s)
    return {name for name, created_at, updated_at in session.execute(
        select(BaseModelEntry.name, BaseModelEntry.created_at, BaseModelEntry.updated_at)
        .where(BaseModelEntry.name.in_(list(models))))
        if as_utc(updated_at or created_at) > recent}


def live_packs(session: Session, costs: dict[str, ModelCost] | None, now: datetime,
               read: MembersRead | None = None) -> tuple[LivePack, ...]:
    """Running packs with free slots (packs recorded before back-filling existed have no capacity: none; a
    quarantined worker's: none either, nor a draining one's, whose packs are handing their trials back), each
    predicted to end by ``costs`` (None: not predicted, `busy_for_s` 0: only whether there are any matters).
    ``read``: members already read in this transaction (`running_members`)."""
    packs = session.scalars(
        select(Pack).where(Pack.state == states.PACK_RUNNING, Pack.capacity.is_not(None),
                           Pack.worker_id.not_in(quarantined_worker_ids(session, now)),
                           Pack.worker_id.not_in(select(Worker.id).where(Worker.state == states.WORKER_DRAINING)))
    ).all()
    weights = {t.id: max(1, round(t.weight or 1.0)) for t in session.scalars(select(Tenant))} if packs else {}
    # A pack that shares its worker with another takes no back-fill: the worker reserved its planned bytes beside
    # the other's (worker/colocation.py), and more members would pass them.
    shared = set(session.scalars(select(Pack.worker_id).where(Pack.state.in_(states.PACK_LIVE))
                                 .group_by(Pack.worker_id).having(func.count() > 1)))
    out = []
    candidates = [p for p in packs if p.worker_id not in shared]
    members = running_members(session, [p.id for p in candidates], read)
    for pack in candidates:
        rows = members[pack.id]
        assert pack.capacity is not None
        free = pack.capacity - len(rows)
        if free <= 0 or not rows:  # no member left: the pack is ending, a back-fill would only bounce
            continue
        out.append(LivePack(
            pack_id=pack.id, worker_id=pack.worker_id, base_model=pack.base_model, free_slots=free,
            members=len(rows), max_rank=pack.max_rank or 0, target_modules=tuple(pack.target_modules or ()),
            tokens_per_step=sum(trial_tokens_per_step(trial, task) for trial, task in rows),
            busy_for_s=predicted_remaining_s(session, pack, costs, rows) if costs is not None else 0.0,
            task_ids=frozenset(task.id for _trial, task in rows),
            member_list=tuple(
                RunningMember(trial.id, task.tenant_id, weights.get(task.tenant_id, 1),
                           max(1, trial.total_steps - trial.steps_done), trial_tokens_per_step(trial, task))
                for trial, task in rows
            ),
        ))  # fmt: skip
    return tuple(out)


def record_plan(session: Session, plan: Plan, now: datetime, result: PlanResult | None = None,
                costs: Mapping[str, ModelCost] | None = None) -> list[str]:
    """Writes the planned packs and back-fills and moves their trials to running; returns the new pack ids. With
    ``costs``, each pack's predicted peak bytes (`planned_bytes`), kept up to date as back-fills join it.

    A back-filled trial is `awaiting_admission` until its worker confirms it joined (`trial.admitted`).
    With the solver's `result`, each task that got trials placed also gets a `task.planned` event with the
    replan's solve time and status (the replans that place nothing leave no event: they repeat each round).
    """
    pack_ids = []
    placed: dict[str, tuple[str, int]] = {}  # task -> (tenant, trials placed)

    def start(trial_id: str, pack: Pack, backfill: bool) -> None:
        trial = session.get(Trial, trial_id)
        assert trial is not None and trial.state == states.TRIAL_PENDING, trial_id
        trial.state = states.TRIAL_RUNNING
        trial.pack_id = pack.id
        trial.attempts += 1
        trial.not_before = None
        trial.started_at = now
        trial.awaiting_admission = backfill
        how = f"back-filled into running pack {pack.id} on" if backfill else "placed on"
        record_event(
            session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id,
            type="trial.running", message=f"trial {trial.index} {how} worker {pack.worker_id}",
            data={"pack_id": pack.id, "worker_id": pack.worker_id, "attempt": trial.attempts, "backfill": backfill},
        )
        tenant, n = placed.get(trial.task_id, (trial.tenant_id, 0))
        placed[trial.task_id] = (tenant, n + 1)

    for planned in plan.packs:
        worker = session.get(Worker, planned.worker_id)
        pack = Pack(id=new_id("pack"), worker_id=planned.worker_id, base_model=planned.base_model,
                    state=states.PACK_PLANNED, trial_ids=list(planned.trial_ids), created_at=now,
                    capacity=planned.max_trials_per_pack, max_rank=planned.max_rank, gpus=worker.gpus if worker else 1,
                    target_modules=list(planned.target_modules) if planned.target_modules is not None else None)
        session.add(pack)
        for trial_id in planned.trial_ids:
            start(trial_id, pack, backfill=False)
        pack.memory_bytes = planned_bytes(session, pack, costs)
        pack_ids.append(pack.id)
    for backfill in plan.backfills:
        live = session.get(Pack, backfill.pack_id, with_for_update={"key_share": True})
        if live is None or live.state != states.PACK_RUNNING:  # it ended since the snapshot: try next round
            continue
        live.trial_ids = [*live.trial_ids, *backfill.trial_ids]
        for trial_id in backfill.trial_ids:
            start(trial_id, live, backfill=True)
        live.memory_bytes = planned_bytes(session, live, costs)
    if result is not None:
        for task_id, (tenant_id, n) in placed.items():
            record_event(
                session, tenant_id=tenant_id, task_id=task_id, type="task.planned",
                message=f"planner placed {n} trial(s) ({result.status}, {result.solve_s * 1000:.0f} ms)",
                data={"trials_placed": n, "solve_ms": round(result.solve_s * 1000, 1), "status": result.status,
                      "planned_makespan_s": result.makespan, "packs_started": len(plan.packs),
                      "backfills": sum(len(b.trial_ids) for b in plan.backfills)},
            )
    return pack_ids


def planned_bytes(session: Session, pack: Pack, costs: Mapping[str, ModelCost] | None) -> int | None:
    """The pack's predicted peak bytes with its running trials: its base model's memory model (fitted on pack
    profiles, else the priors of its size) at their pooled tokens per step. None without ``costs``."""
    if costs is None:
        return None
    session.flush()
    rows = session.execute(select(Trial, Task).join(Task, Task.id == Trial.task_id)
                           .where(Trial.pack_id == pack.id, Trial.state == states.TRIAL_RUNNING)).all()
    memory = costs.get(pack.base_model, PRIOR_COST).memory
    return memory.predict(sum(trial_tokens_per_step(trial, task) for trial, task in rows), 0)


def admission_requests(session: Session) -> dict[str, tuple[str, list[Trial]]]:
    """Back-filled trials their worker has not confirmed yet: pack -> (worker, trials)."""
    rows = session.execute(
        select(Pack.id, Pack.worker_id, Trial)
        .join(Trial, Trial.pack_id == Pack.id)
        .where(Pack.state == states.PACK_RUNNING, Trial.state == states.TRIAL_RUNNING,
               Trial.awaiting_admission.is_(True))
    ).all()
    out: dict[str, tuple[str, list[Trial]]] = {}
    for pack_id, worker_id, trial in rows:
        out.setdefault(pack_id, (worker_id, []))[1].append(trial)
    return out


def stop_requests(session: Session) -> dict[tuple[str, str], tuple[str, list[Trial]]]:
    """Live packs still training trials the scheduler has ended (a cancelled task, an early exit):
    (pack, mode) -> (worker, trials); mode "export" for an overfitting exit (its best adapter is kept)."""
    rows = session.execute(
        select(Pack.id, Pack.worker_id, Trial)
        .join(Trial, Trial.pack_id == Pack.id)
        .where(Pack.state.in_(states.PACK_LIVE),
               Trial.state.in_((states.TRIAL_CANCELLED, states.TRIAL_STOPPED_EARLY)),
               Trial.finished_at.is_not(None))
    ).all()
    out: dict[tuple[str, str], tuple[str, list[Trial]]] = {}
    for pack_id, worker_id, trial in rows:
        out.setdefault((pack_id, stop_mode(trial)), (worker_id, []))[1].append(trial)
    return out
