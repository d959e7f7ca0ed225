"""What the operator's views read: packs with the trials in their slots, and the fleet's load.

A slot is held by a trial that runs in the pack now (`Trial.pack_id` stays set on a finished trial, so the
state decides). A fixed number of queries for any number of packs or workers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
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
    stmt = (select(Trial).where(Trial.pack_id.in_(pack_ids), Trial.state == TRIAL_RUNNING)
            .order_by(Trial.task_id, Trial.index))
    for t in session.scalars(stmt):
        assert t.pack_id is not None
        out[t.pack_id].append(PackSlot(
            trial_id=t.id, task_id=t.task_id, tenant_id=t.tenant_id, index=t.index, state=t.state,
            steps_done=t.steps_done, total_steps=t.total_steps, awaiting_admission=t.awaiting_admission,
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


def cluster_view(session: Session) -> ClusterOut:
    workers = session.scalars(select(Worker).order_by(Worker.registered_at, Worker.id)).all()
    live = session.scalars(select(Pack).where(Pack.state.in_(PACK_LIVE)).order_by(Pack.created_at)).all()
    held = _slots(session, [p.id for p in live])
    packs_of: dict[str, list[WorkerPack]] = defaultdict(list)  # a worker runs up to its max_packs at once
    for p in live:
        packs_of[p.worker_id].append(WorkerPack(id=p.id, base_model=p.base_model, state=p.state,
                                                used_slots=len(held.get(p.id, [])), memory_bytes=p.memory_bytes))

    loads = []
    for w in workers:
        packs = packs_of.get(w.id, [])
        n = sum(p.used_slots for p in packs)
        loads.append(WorkerLoad(
            **WorkerOut.of(w).model_dump(), pack_id=packs[0].id if packs else None, packs=packs, used_slots=n,
            utilisation=round(min(1.0, n / w.max_slots), 4) if w.max_slots else 0.0,
        ))
    alive = [w for w in loads if w.state == WORKER_ALIVE]
    slots_total = sum(w.max_slots for w in alive)
    slots_used = sum(w.used_slots for w in alive)

    by_tenant: dict[str, dict[str, int]] = defaultdict(lambda: {"pending": 0, "running": 0})
    active = (select(Trial.tenant_id, Trial.state, func.count()).where(
        Trial.state.in_((TRIAL_PENDING, TRIAL_WAITING, TRIAL_RUNNING))).group_by(Trial.tenant_id, Trial.state))
    for tenant_id, state, count in session.execute(active):
        by_tenant[tenant_id]["running" if state == TRIAL_RUNNING else "pending"] += count
    # Preemption's view of each tenant (scheduler/service/fairness.py): its weight, its GPU time over the window,
    # and its trials held back for another tenant.
    now = utcnow()
    window_s = policy_from(get_settings()).window_s
    used = gpu_seconds_by_tenant(session, (now - timedelta(seconds=window_s), now), now)
    held_by = dict(session.execute(select(Trial.tenant_id, func.count()).where(
        Trial.state == TRIAL_PENDING, Trial.preempted_for.is_not(None)).group_by(Trial.tenant_id)).all())
    rows: dict[str, tuple[str, float]] = {tenant_id: (name, weight) for tenant_id, name, weight in session.execute(
        select(Tenant.id, Tenant.name, Tenant.weight).where(Tenant.id.in_(list(by_tenant))))} if by_tenant else {}
    waiting = _waiting_tasks(session)
    tenants = sorted(
        (TenantLoad(tenant_id=t, name=name, pending_trials=c["pending"], running_trials=c["running"],
                    weight=weight or 1.0, gpu_seconds_window=round(used.get(t, 0.0), 1),
                    held_trials=int(held_by.get(t, 0)), waiting=waiting.get(t, []))
         for t, c in by_tenant.items() for name, weight in [rows.get(t, (t, 1.0))]),
        key=lambda t: (-t.running_trials, -t.pending_trials, t.name))

    return ClusterOut(
        workers_alive=len(alive), workers_lost=len(loads) - len(alive),
        workers_quarantined=sum(1 for w in alive if w.quarantined_until is not None),
        workers_busy=sum(1 for w in alive if w.pack_id), slots_total=slots_total, slots_used=slots_used,
        utilisation=round(min(1.0, slots_used / slots_total), 4) if slots_total else 0.0,
        trials_pending=sum(c["pending"] for c in by_tenant.values()),
        trials_running=sum(c["running"] for c in by_tenant.values()),
        workers=loads, tenants=tenants,
    )


def _waiting_tasks(session: Session) -> dict[str, list[WaitingTask]]:
    """Each tenant's tasks with pending trials, with why they wait (the scheduler's `Task.waiting`,
    scheduler/service/waits.py; as a task's own view shows it: only while a trial is pending)."""
    out: dict[str, list[WaitingTask]] = defaultdict(list)
    pending = select(Trial.task_id).where(Trial.state == TRIAL_PENDING).distinct()
    for task in session.scalars(select(Task).where(Task.waiting.is_not(None), Task.id.in_(pending))
                                .order_by(Task.created_at, Task.id)):
        out[task.tenant_id].append(WaitingTask(task_id=task.id, waiting=TaskWaiting.model_validate(task.waiting)))
    return out
