"""What the operator's views read: packs with the trials in their slots, and the fleet's load.

A slot is held by a trial that runs in the pack now (`Trial.pack_id` stays set on a finished trial, so the
state decides). A fixed number of queries for any number of packs or workers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, distinct, func, or_, select
from sqlalchemy.orm import Session

from api.schemas.admin import WorkerOut
from api.schemas.cluster import (
    ClusterOut,
    PackOut,
    PackPhases,
    PackProfileOut,
    PackSlot,
    StepBreakdown,
    TenantLoad,
    WaitingTask,
    WorkerLoad,
    WorkerPack,
)
from api.schemas.tasks import TaskWaiting
from common.pack_phases import number, phase_seconds
from common.settings import get_settings
from common.states import (
    PACK_LIVE,
    TRIAL_PENDING,
    TRIAL_RUNNING,
    TRIAL_WAITING,
    WORKER_ALIVE,
)
from common.tables import Pack, Task, Tenant, Trial, Worker, utcnow
from common.usage import gpu_seconds_by_tenant
from scheduler.planning.fairness import policy_from


def _slots(session: Session, pack_ids: Sequence[str]) -> dict[str, list[PackSlot]]:
    out: dict[str, list[PackSlot]] = defaultdict(list)
    if not pack_ids:
        return out
    # The columns a slot shows, not whole trials (their hyperparameters' JSON was most of a page's time).
    stmt = (select(Trial.pack_id, Trial.id, Trial.task_id, Trial.tenant_id, Trial.index, Trial.state,
                   Trial.steps_done, Trial.total_steps, Trial.awaiting_admission)
            .where(Trial.pack_id.in_(pack_ids), Trial.state == TRIAL_RUNNING).order_by(Trial.task_id, Trial.index))
    for pack_id, trial_id, task_id, tenant_id, index, state, steps_done, total_steps, awaiting in session.execute(stmt):
        out[str(pack_id)].append(PackSlot(
            trial_id=trial_id, task_id=task_id, tenant_id=tenant_id, index=index, state=state, steps_done=steps_done,
            total_steps=total_steps, awaiting_admission=awaiting,
        ))
    return out


def _capacity(pack: Pack) -> int:
    # Packs that take no back-fills have no recorded capacity: they were sized for the trials they started with.
    return pack.capacity if pack.capacity is not None else len(pack.trial_ids)


def profile_phases(raw: dict[str, Any]) -> PackPhases:
    """The phases of a `pack.profile` report's `phases` (common/pack_phases.py reads them)."""
    return PackPhases(wall_s=number(raw.get("wall_s")), outside_steps_frac=number(raw.get("outside_steps_frac")),
                      **phase_seconds(raw))


def _integer(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    n = number(value)
    return int(n) if n is not None and n.is_integer() else None


def profile_view(raw: dict[str, Any], *, samples: bool) -> PackProfileOut:
    """A pack's stored profile (worker/profile.py's summary plus `phases`, and `gpus` on several GPUs) as the
    API types it; its per-step samples only when asked (the single pack's read)."""
    phases, breakdown = raw.get("phases"), raw.get("step_breakdown_s")
    rows, fields = raw.get("samples"), raw.get("sample_fields")
    return PackProfileOut(
        device=raw["device"] if isinstance(raw.get("device"), str) else None, gpus=_integer(raw.get("gpus")),
        steps=_integer(raw.get("steps")), first_step_s=number(raw.get("first_step_s")),
        seconds=number(raw.get("seconds")),
        tokens_per_s=number(raw.get("tokens_per_s")), padded_fraction=number(raw.get("padded_fraction")),
        peak_memory_bytes=_integer(raw.get("peak_memory_bytes")), captured_steps=_integer(raw.get("captured_steps")),
        shared_device=raw.get("shared_device") is True,
        step_breakdown_s=StepBreakdown(**{k: number(breakdown.get(k)) for k in StepBreakdown.model_fields})
        if isinstance(breakdown, dict) else None,
        phases=profile_phases(phases) if isinstance(phases, dict) else None,
        sample_fields=[str(f) for f in fields] if isinstance(fields, list) else None,
        samples=[[_sample_value(v) for v in row] for row in rows if isinstance(row, list)]
        if samples and isinstance(rows, list) else None,
    )


def _sample_value(value: Any) -> int | float | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else number(value)


def pack_views(session: Session, packs: Sequence[Pack], *, samples: bool = False) -> list[PackOut]:
    # An ended pack holds no slot, whatever a stale trial row says.
    slots = _slots(session, [p.id for p in packs if p.state in PACK_LIVE])
    out = []
    for p in packs:
        capacity, held = _capacity(p), slots.get(p.id, [])
        progress = p.progress or {}
        step_s, tokens = progress.get("step_s"), progress.get("tokens")
        out.append(PackOut(
            id=p.id, worker_id=p.worker_id, base_model=p.base_model, state=p.state, capacity=capacity, slots=held,
            free_slots=max(0, capacity - len(held)),
            utilisation=round(min(1.0, len(held) / capacity), 4) if capacity else 0.0,
            trials_placed=len(p.trial_ids), max_rank=p.max_rank, target_modules=p.target_modules,
            memory_bytes=p.memory_bytes, step_s=step_s,
            tokens_per_s=round(tokens / step_s, 1) if step_s and tokens is not None else None,
            profile=profile_view(p.profile, samples=samples) if isinstance(p.profile, dict) else None,
            created_at=p.created_at, started_at=p.started_at, finished_at=p.finished_at,
        ))
    return out


DEFAULT_WORKERS_SHOWN = 100  # the cluster view's page of workers (`limit`), and its most
MAX_WORKERS_SHOWN = 500


def cluster_view(session: Session, *, limit: int = DEFAULT_WORKERS_SHOWN, after: Worker | None = None) -> ClusterOut:
    """The fleet's figures over every worker (SQL aggregates); one page of its workers (registered first, first),
    each with its live packs; the tenants with pending or running trials. A fixed number of queries, none of them
    returning a row per worker, pack or trial of the whole cluster."""
    now = utcnow()
    fleet = _fleet(session, now)
    stmt = select(Worker)
    if after is not None:
        stmt = stmt.where(or_(Worker.registered_at > after.registered_at,
                              and_(Worker.registered_at == after.registered_at, Worker.id > after.id)))
    page = session.scalars(stmt.order_by(Worker.registered_at, Worker.id).limit(limit + 1)).all()
    packs_of = _live_packs(session, [w.id for w in page[:limit]])
    loads = []
    for w in page[:limit]:
        packs = packs_of.get(w.id, [])
        n = sum(p.used_slots for p in packs)
        loads.append(WorkerLoad(
            **WorkerOut.of(w).model_dump(), pack_id=packs[0].id if packs else None, packs=packs, used_slots=n,
            utilisation=round(min(1.0, n / w.max_slots), 4) if w.max_slots else 0.0,
        ))
    tenants = _tenant_loads(session, now)
    slots_total, slots_used = fleet["slots_total"], fleet["slots_used"]
    return ClusterOut(
        workers_alive=fleet["alive"], workers_lost=fleet["total"] - fleet["alive"],
        workers_quarantined=fleet["quarantined"], workers_busy=fleet["busy"], slots_total=slots_total,
        slots_used=slots_used, utilisation=round(min(1.0, slots_used / slots_total), 4) if slots_total else 0.0,
        trials_pending=sum(t.pending_trials for t in tenants), trials_running=sum(t.running_trials for t in tenants),
        workers=loads, workers_total=fleet["total"], has_more=len(page) > limit, tenants=tenants,
    )


def _fleet(session: Session, now: datetime) -> dict[str, int]:
    """Workers (all, alive, alive and quarantined), the alive ones' slots, and of those the busy workers (a live
    pack) and the slots their live packs' running trials hold: two aggregate queries."""
    alive = Worker.state == WORKER_ALIVE
    total, n_alive, quarantined, slots_total = session.execute(select(
        func.count(Worker.id), func.count(Worker.id).filter(alive),
        func.count(Worker.id).filter(alive, Worker.quarantined_until > now),
        func.coalesce(func.sum(Worker.max_slots).filter(alive), 0),
    )).one()
    busy, slots_used = session.execute(
        select(func.count(distinct(Pack.worker_id)), func.count(Trial.id))
        .select_from(Pack).join(Worker, Worker.id == Pack.worker_id)
        .outerjoin(Trial, and_(Trial.pack_id == Pack.id, Trial.state == TRIAL_RUNNING))
        .where(Pack.state.in_(PACK_LIVE), alive)).one()
    return {"total": total, "alive": n_alive, "quarantined": quarantined, "slots_total": int(slots_total),
            "busy": busy, "slots_used": slots_used}


def _live_packs(session: Session, worker_ids: Sequence[str]) -> dict[str, list[WorkerPack]]:
    """Each of these workers' live packs, oldest first, with the slots their running trials hold (counted, not
    loaded). A worker runs up to its max_packs at once."""
    out: dict[str, list[WorkerPack]] = defaultdict(list)
    if not worker_ids:
        return out
    columns = (Pack.id, Pack.worker_id, Pack.base_model, Pack.state, Pack.memory_bytes, Pack.created_at)
    stmt = (select(*columns, func.count(Trial.id))
            .outerjoin(Trial, and_(Trial.pack_id == Pack.id, Trial.state == TRIAL_RUNNING))
            .where(Pack.state.in_(PACK_LIVE), Pack.worker_id.in_(worker_ids))
            .group_by(*columns).order_by(Pack.created_at, Pack.id))
    for pack_id, worker_id, base_model, state, memory_bytes, _, used in session.execute(stmt):
        out[worker_id].append(WorkerPack(id=pack_id, base_model=base_model, state=state, used_slots=used,
                                         memory_bytes=memory_bytes))
    return out


def _tenant_loads(session: Session, now: datetime) -> list[TenantLoad]:
    """Tenants with pending or running trials, busiest first, each with preemption's view of it
    (scheduler/service/fairness.py): its weight, its GPU time over the window, its trials held back for another."""
    by_tenant: dict[str, dict[str, int]] = defaultdict(lambda: {"pending": 0, "running": 0})
    active = (select(Trial.tenant_id, Trial.state, func.count()).where(
        Trial.state.in_((TRIAL_PENDING, TRIAL_WAITING, TRIAL_RUNNING))).group_by(Trial.tenant_id, Trial.state))
    for tenant_id, state, count in session.execute(active):
        by_tenant[tenant_id]["running" if state == TRIAL_RUNNING else "pending"] += count
    if not by_tenant:
        return []
    window_s = policy_from(get_settings()).window_s
    used = gpu_seconds_by_tenant(session, (now - timedelta(seconds=window_s), now), now)
    held_by = dict(session.execute(select(Trial.tenant_id, func.count()).where(
        Trial.state == TRIAL_PENDING, Trial.preempted_for.is_not(None)).group_by(Trial.tenant_id)).all())
    rows: dict[str, tuple[str, float]] = {tenant_id: (name, weight) for tenant_id, name, weight in session.execute(
        select(Tenant.id, Tenant.name, Tenant.weight).where(Tenant.id.in_(list(by_tenant))))}
    waiting = _waiting_tasks(session)
    return sorted(
        (TenantLoad(tenant_id=t, name=name, pending_trials=c["pending"], running_trials=c["running"],
                    weight=weight or 1.0, gpu_seconds_window=round(used.get(t, 0.0), 1),
                    held_trials=int(held_by.get(t, 0)), waiting=shown, waiting_tasks=total)
         for t, c in by_tenant.items() for name, weight in [rows.get(t, (t, 1.0))]
         for shown, total in [waiting.get(t, ([], 0))]),
        key=lambda t: (-t.running_trials, -t.pending_trials, t.name))


WAITING_SHOWN = 10  # a tenant's waiting tasks listed (`TenantLoad.waiting`), the oldest: the next to start


def _waiting_tasks(session: Session) -> dict[str, tuple[list[WaitingTask], int]]:
    """Each tenant's tasks with pending trials, with why they wait (the scheduler's `Task.waiting`,
    scheduler/service/waits.py; as a task's own view shows it: only while a trial is pending): its oldest
    `WAITING_SHOWN`, and how many there are."""
    out: dict[str, tuple[list[WaitingTask], int]] = {}
    pending = select(Trial.task_id).where(Trial.state == TRIAL_PENDING).distinct()
    ranked = select(
        Task.id, Task.tenant_id, Task.waiting, Task.created_at,
        func.row_number().over(partition_by=Task.tenant_id, order_by=(Task.created_at, Task.id)).label("rank"),
        func.count().over(partition_by=Task.tenant_id).label("total"),
    ).where(Task.waiting.is_not(None), Task.id.in_(pending)).subquery()
    for task_id, tenant_id, waiting, total in session.execute(
            select(ranked.c.id, ranked.c.tenant_id, ranked.c.waiting, ranked.c.total)
            .where(ranked.c.rank <= WAITING_SHOWN).order_by(ranked.c.created_at, ranked.c.id)):
        shown, _ = out.setdefault(tenant_id, ([], total))
        shown.append(WaitingTask(task_id=task_id, waiting=TaskWaiting.model_validate(waiting)))
    return out
