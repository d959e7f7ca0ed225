"""A queued task explains itself: after each round's plan, why each task's pending trials wait, recorded on the task
(`Task.waiting`, shown as the task's `waiting` field) and, when that is news, told by one `task.waiting` event.

The judging is pure (scheduler/planning/waits.py); this shell reads what it needs (the usable workers, their live
packs with their predicted ends, the tasks held by a requeue backoff), writes the field and the events, and clears
the field of every task none of whose trials waits any more. Inside the round's transaction (daemon.py).

The field is written when it changed (a new reason, position or message, or a start moved by more than
`ETA_STILL_S`), not every round; `updated_at` says when. What the task was last told is kept in the field
(`told`, not shown by the API), so an event is recorded only when `worth_telling` says the change is news.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from common import states
from common.events import record_event
from common.tables import Pack, Task, Trial, as_utc
from common.webhooks import iso
from scheduler.planning.cost import ModelCost
from scheduler.planning.placement import UNIT_S
from scheduler.planning.types import LiveWorker, Plan, PlanResult, Snapshot
from scheduler.planning.waits import Backoff, BusyPack, TaskWait, start_at, task_waits, worth_telling
from scheduler.service.cluster_state import (
    load_costs,
    predicted_remaining_s,
    running_members,
    usable_workers,
    worker_models,
    worker_warm,
)
from scheduler.service.planner_io import unjudged_models

WAITING = "task.waiting"
ETA_STILL_S = 10.0  # a predicted start that moved less than this is not written again


def note_task_waits(session: Session, snapshot: Snapshot, plan: Plan, result: PlanResult | None, now: datetime,
                    timeout_s: float, costs: dict[str, ModelCost] | None = None) -> None:
    """Judges and records why each task of the snapshot (and each task held by a requeue backoff) still waits
    after ``plan``; clears the field of the others. ``costs``: the round's cost models when it loaded them."""
    started = {t for p in plan.packs for t in p.trial_ids} | {t for b in plan.backfills for t in b.trial_ids}
    backoffs = _backoffs(session, {t.task_id for t in snapshot.pending}, now)
    waits: list[TaskWait] = []
    if any(t.trial_id not in started for t in snapshot.pending) or backoffs:
        workers = usable_workers(session, now, timeout_s)
        packs = _busy_packs(session, [w.id for w in workers], costs)
        live = [LiveWorker(w.id, w.max_slots, w.memory_bytes, worker_models(w), gpus=w.gpus, warm=worker_warm(w))
                for w in workers]
        models = {t.base_model for t in snapshot.pending if not any(w.can_load(t.base_model) for w in live)}
        waits = task_waits(snapshot.pending, started, live, packs, result, unit_s=UNIT_S,
                           unjudged_models=unjudged_models(session, sorted(models), now, timeout_s),
                           backoffs=backoffs, live_packs=snapshot.live_packs, costs=costs)
    for wait in waits:
        _record(session, session.get_one(Task, wait.task_id), wait, now)
    judged = {w.task_id for w in waits}
    for task in session.scalars(select(Task).where(Task.waiting.is_not(None))):
        if task.id not in judged:
            task.waiting = None  # its trials started (or ended): nothing waits


def _busy_packs(session: Session, worker_ids: Sequence[str], costs: dict[str, ModelCost] | None) -> list[BusyPack]:
    """The live packs of these workers (this round's new ones included), each with its predicted end."""
    packs = session.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE), Pack.worker_id.in_(worker_ids))).all()
    if not packs:
        return []
    if costs is None:
        costs = load_costs(session, {p.base_model for p in packs})
    # Every pack's members in one query (a query a pack was a tenth of a round at 256 workers).
    members = running_members(session, [p.id for p in packs])
    return [BusyPack(pack_id=p.id, worker_id=p.worker_id, base_model=p.base_model, trials=len(members[p.id]),
                     ends_in_s=predicted_remaining_s(session, p, costs, members[p.id])) for p in packs]


def _backoffs(session: Session, in_snapshot: set[str], now: datetime) -> list[Backoff]:
    """Tasks (queued or running) whose pending trials all wait out a requeue backoff, oldest task first."""
    rows = session.execute(
        select(Task.id, Task.tenant_id, Task.base_model, func.count(Trial.id), func.min(Trial.not_before))
        .join(Trial, Trial.task_id == Task.id)
        .where(Task.state.in_((states.TASK_QUEUED, states.TASK_RUNNING)), Trial.state == states.TRIAL_PENDING,
               Trial.not_before > now)
        .group_by(Task.id, Task.tenant_id, Task.base_model)
        .order_by(func.min(Task.created_at), Task.id)
    ).all()
    return [Backoff(task_id, tenant_id, model, n, (as_utc(first) - now).total_seconds())
            for task_id, tenant_id, model, n, first in rows if task_id not in in_snapshot and first is not None]


def _record(session: Session, task: Task, wait: TaskWait, now: datetime) -> None:
    """Writes the task's field when it changed, and a `task.waiting` event when the change is news."""
    stored = task.waiting or {}
    told_before = stored.get("told")
    told = (told_before["reason"], told_before["position"], _time(told_before["estimated_start_at"]),
            _time(told_before.get("told_at"))) if told_before else None
    at = start_at(wait, now)
    value: dict[str, Any] = {
        "reason": wait.reason, "message": wait.message, "position": wait.position,
        "estimated_start_at": iso(at), "waiting_trials": wait.waiting_trials,
        "base_model": wait.base_model, "pack_id": wait.pack_id, "worker_id": wait.worker_id,
        "told": told_before,
    }
    if worth_telling(told, wait, now):
        value["told"] = {"reason": wait.reason, "position": wait.position, "estimated_start_at": value[
            "estimated_start_at"], "told_at": iso(now)}
        record_event(session, tenant_id=task.tenant_id, task_id=task.id, type=WAITING, message=wait.message,
                     data={k: value[k] for k in ("reason", "position", "estimated_start_at", "waiting_trials",
                                                 "base_model", "pack_id", "worker_id")}
                     | {"starts_in_s": None if wait.starts_in_s is None else round(wait.starts_in_s, 1)})
    if not _same(stored, value):
        task.waiting = value | {"updated_at": iso(now)}


def _same(stored: dict[str, Any], value: dict[str, Any]) -> bool:
    """Nothing worth writing: every field as stored, the predicted start within `ETA_STILL_S`."""
    keys = [k for k in value if k != "estimated_start_at"]
    if any(stored.get(k) != value[k] for k in keys):
        return False
    old, new = _time(stored.get("estimated_start_at")), _time(value["estimated_start_at"])
    if old is None or new is None:
        return old is new
    return abs((new - old).total_seconds()) < ETA_STILL_S


def _time(value: str | None) -> datetime | None:
    return None if value is None else as_utc(datetime.fromisoformat(value.replace("Z", "+00:00")))
