"""Task events: the user-visible log of everything that happened to a task (stored in the database).

Readers page and stream a task's events by id (`after=`, `Last-Event-ID`), so within one task ids must
become visible in increasing order. A sequence alone does not promise that: two transactions can take ids
10 and 11 and commit 11 first, and a reader that saw 11 would never see 10. On Postgres every transaction
that writes a task's event therefore first takes that task's transaction-scoped advisory lock, so writers
of one task's events commit one after the other, in id order. (SQLite has a single writer already.)
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from common.db import transaction_memo
from common.tables import Event
from common.webhooks import enqueue_deliveries

_LOCKED = "loraplane.event_locks"  # `transaction_memo` key: the tasks the transaction already locked


def _serialise_task_events(session: Session, task_id: str) -> None:
    if session.get_bind().dialect.name != "postgresql":
        return
    # The lock ends with the transaction, so remember it per transaction, not per session.
    locked = transaction_memo(session, _LOCKED)
    if task_id not in locked:
        session.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"events:{task_id}"))))
        locked[task_id] = True


def record_event(
    session: Session,
    *,
    tenant_id: str,
    task_id: str,
    type: str,
    message: str,
    level: str = "info",
    trial_id: str | None = None,
    data: dict[str, Any] | None = None,
) -> Event:
    _serialise_task_events(session, task_id)
    event = Event(
        tenant_id=tenant_id,
        task_id=task_id,
        trial_id=trial_id,
        type=type,
        level=level,
        message=message,
        data=data or {},
    )
    session.add(event)
    # Webhook deliveries of the event, in its transaction (the outbox): committed with it or not at all.
    enqueue_deliveries(session, event)
    return event
