"""Preemption in the running service (issue 34): the rule of scheduler/planning/fairness.py applied after each
round's plan, its decisions made into trial state, events and pause commands.

- After the plan, the pending trials it placed nowhere, with no idle worker left (room beside running packs that
  the plan left unused does not count: what waits did not fit there), are the waiting ones. The running
  packs, each tenant's GPU time over the window (the GPU seconds its usage bills, common/usage.py) and the
  tenants' weights go to `preemptions`.
- A chosen pack's running members are paused at their next checkpoint (the pause command early exit sends; the
  worker checkpoints them and the pack ends with its last member). Each gets `preemptions` + 1 and
  `preempted_for` (the tenant it makes room for), a `trial.preempted` event with the reason, and back in pending
  (ingest `_trial_paused`) it is held out of the plans (`not_before`) for at most one slice, and no longer than
  that tenant has pending trials (`release_held`), so the freed worker goes to the tenant it was freed for.
- A pack whose pause is already asked is not chosen again; the pause is sent from the mark (`pause_requests`),
  again after a scheduler restart.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from common import states
from common.events import record_event
from common.tables import Pack, Tenant, Trial, as_utc
from common.usage import gpu_seconds_by_tenant
from scheduler.planning.fairness import FairnessPolicy, PackView, WaitingTrial, past_slice, preemptions
from scheduler.planning.types import Plan, Snapshot
from scheduler.service.exits import PauseRequest, placement


def preempt_for_waiting(session: Session, snapshot: Snapshot, plan: Plan, now: datetime,
                        policy: FairnessPolicy) -> list[str]:
    """Marks the running trials to pause to make room for pending trials this round's plan could not place (see
    the module); returns the packs preempted. `pause_requests` reads the marks and the daemon sends them."""
    placed = {i for p in plan.packs for i in p.trial_ids} | {i for b in plan.backfills for i in b.trial_ids}
    used = {p.worker_id for p in plan.packs}
    if any(w.worker_id not in used and not w.beside_packs for w in snapshot.idle_workers):
        return []  # a worker is free: the planner chose to wait for something else, not for room
    waiting = [WaitingTrial(t.trial_id, t.tenant_id, t.gpus_needed) for t in snapshot.pending
               if t.trial_id not in placed]
    if not waiting:
        return []
    packs = session.scalars(select(Pack).where(Pack.state == states.PACK_RUNNING, Pack.started_at.is_not(None))).all()
    # Columns, not rows: the running trials of every pack are read each round this far (at 256 workers, 8,192 trial
    # rows were a tenth of a round's CPU); only the preempted packs' trials are read whole, below.
    members: dict[str, list[Row[str | None, str, int, str | None]]] = {p.id: [] for p in packs}
    for row in session.execute(select(Trial.pack_id, Trial.tenant_id, Trial.preemptions, Trial.preempted_for)
                               .where(Trial.pack_id.in_(list(members)), Trial.state == states.TRIAL_RUNNING)):
        members[row.pack_id or ""].append(row)
    # SQLite (the embedded default) gives times back without their zone: as_utc, as everywhere times are compared.
    views = [PackView(p.id, p.gpus, (now - as_utc(p.started_at)).total_seconds() if p.started_at else 0.0,
                      frozenset(t.tenant_id for t in members[p.id]), tuple(t.preemptions for t in members[p.id]))
             for p in packs if members[p.id] and not any(t.preempted_for for t in members[p.id])]
    if not past_slice(views, policy):
        return []  # most rounds: no pack may be preempted yet, so the GPU time over the window is not read
    weights = {tenant_id: max(1, round(weight or 1.0)) for tenant_id, weight in session.execute(
        select(Tenant.id, Tenant.weight).where(Tenant.id.in_({w.tenant_id for w in waiting}
                                                             | {t for v in views for t in v.tenants})))}
    # The same GPU seconds the tenants are billed (common/usage.py).
    usage = gpu_seconds_by_tenant(session, (now - timedelta(seconds=policy.window_s), now), now)
    preempted = []
    by_id = {p.id: p for p in packs}
    for choice in preemptions(views, waiting, usage, weights, policy):
        preempted.append(choice.pack_id)
        pack = by_id[choice.pack_id]
        for trial in session.scalars(select(Trial).where(Trial.pack_id == pack.id, Trial.state == states.TRIAL_RUNNING)
                                     .order_by(Trial.id)):
            trial.preemptions += 1
            trial.preempted_for = choice.for_tenant
            trial.not_before = now + timedelta(seconds=policy.min_slice_s)
            record_event(session, tenant_id=trial.tenant_id, task_id=trial.task_id, trial_id=trial.id,
                         type="trial.preempted",
                         message=f"trial {trial.index}: {choice.reason}; it pauses at its next checkpoint and "
                                 f"resumes from it (preemption {trial.preemptions} of at most {policy.max_pauses})",
                         data={"pack_id": pack.id, "for_tenant": choice.for_tenant,
                               "preemptions": trial.preemptions})
    return preempted


def pause_requests(session: Session) -> list[PauseRequest]:
    """The running trials marked for preemption, to pause: read from the database each round, so that a pause a
    restarted scheduler never sent is sent then (the worker takes each once)."""
    rows = session.execute(select(Trial, Pack.worker_id).join(Pack, Pack.id == Trial.pack_id).where(
        Trial.state == states.TRIAL_RUNNING, Trial.preempted_for.is_not(None), Pack.state.in_(states.PACK_LIVE)))
    return [PauseRequest(trial.pack_id or "", worker_id, trial.id, placement(trial)) for trial, worker_id in rows]


def release_held(session: Session, now: datetime) -> None:
    """Gives held trials back to the planner once the tenant they made room for has no trial left pending."""
    held = session.scalars(select(Trial).where(Trial.state == states.TRIAL_PENDING,
                                               Trial.preempted_for.is_not(None))).all()
    if not held:
        return
    waiting_tenants = _tenants_with_pending(session, {t.preempted_for for t in held if t.preempted_for})
    for trial in held:
        not_before = as_utc(trial.not_before) if trial.not_before is not None else None
        if trial.preempted_for not in waiting_tenants or (not_before is not None and not_before <= now):
            trial.preempted_for = None
            if not_before is not None and not_before > now:
                trial.not_before = None


def _tenants_with_pending(session: Session, tenants: Iterable[str]) -> set[str]:
    return set(session.scalars(select(Trial.tenant_id).where(
        Trial.tenant_id.in_(set(tenants)), Trial.state == states.TRIAL_PENDING,
        Trial.preempted_for.is_(None)).distinct()).all())
