"""Webhooks, the part every writer shares: which event types are sent, and the outbox rows an event enqueues.

`record_event` (common/events.py) calls `enqueue_deliveries` for the types in `WEBHOOK_EVENTS`, in the event's own
transaction: the event and its deliveries commit together or not at all, so no sender crash, API crash or
scheduler crash can lose a delivery or announce an event that was rolled back. The sender is
scheduler/service/webhooks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from common.db import transaction_memo
from common.secret_box import SecretBox, SecretUnreadable
from common.tables import Event, Task, Tracker, WebhookDelivery, WebhookEndpoint, as_utc, new_id, utcnow

WEBHOOK_EVENTS = ("task.succeeded", "task.failed", "task.cancelled", "trial.completed")

DELIVERY_PENDING = "pending"
DELIVERY_DELIVERED = "delivered"
DELIVERY_FAILED = "failed"  # every attempt was used up


def iso(value: datetime | None) -> str | None:
    return None if value is None else as_utc(value).astimezone(UTC).isoformat().replace("+00:00", "Z")


def task_summary(task: Task | None) -> dict[str, Any] | None:
    """What a receiver most often needs without calling back: the task's state and best trial."""
    if task is None:
        return None
    return {"id": task.id, "state": task.state, "base_model": task.base_model, "best_trial_id": task.best_trial_id,
            "error": task.error, "created_at": iso(task.created_at), "finished_at": iso(task.finished_at)}


def event_payload(event: Event, task: Task | None) -> dict[str, Any]:
    return {"id": event.id, "type": event.type, "created_at": iso(event.created_at), "task_id": event.task_id,
            "trial_id": event.trial_id, "data": event.data or {}, "task": task_summary(task)}


_ENDPOINTS = "loraplane.webhook_endpoints"  # `transaction_memo` key: the endpoints read in it, by tenant


def _tenant_endpoints(session: Session, tenant_id: str) -> list[WebhookEndpoint]:
    """The tenant's endpoints, read once a transaction: the scheduler records events of many trials in one (a query
    an event was an eighth of the serial part of its ingest at 256 workers)."""
    endpoints = transaction_memo(session, _ENDPOINTS)
    if tenant_id not in endpoints:
        endpoints[tenant_id] = list(session.scalars(
            select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)))
    return endpoints[tenant_id]


def enqueue_deliveries(session: Session, event: Event) -> list[WebhookDelivery]:
    """One pending delivery per endpoint of the event's tenant that subscribed to its type (none: nothing)."""
    if event.type not in WEBHOOK_EVENTS:
        return []
    endpoints = [e for e in _tenant_endpoints(session, event.tenant_id) if event.type in (e.events or [])]
    if not endpoints:
        return []
    session.flush()  # the event's id and time go into the body
    # The task as this transaction leaves it (the writer changed it before recording the event).
    body = event_payload(event, session.get(Task, event.task_id))
    now = utcnow()
    deliveries = [WebhookDelivery(id=new_id("whd"), tenant_id=event.tenant_id, endpoint_id=e.id, event_id=event.id,
                                  event_type=event.type, payload=body, state=DELIVERY_PENDING, attempts=0,
                                  next_attempt_at=now, created_at=now)
                  for e in endpoints]
    session.add_all(deliveries)
    return deliveries


@dataclass
class Rotation:
    """What `rotate_secrets` did: secrets re-encrypted under the first key, those already under it, and the rows
    (webhook endpoints `wh-...`, trackers `trk-...`) whose secret no configured key decrypts (left as they are)."""

    rotated: int = 0
    current: int = 0
    unreadable: list[str] = field(default_factory=list)


def rotate_secrets(session: Session, box: SecretBox) -> Rotation:
    """Re-encrypts every secret the database keeps (webhook signing secrets, experiment trackers' tokens) that is
    not under the box's first key (`loraplane rotate-secrets`). Once it reports nothing unreadable, every secret is
    under the first key and the older keys may be dropped. Safe to run again, and beside a running service: a row is
    rewritten whole, with the same secret."""
    result = Rotation()
    endpoints = select(WebhookEndpoint).order_by(WebhookEndpoint.id).with_for_update(key_share=True)
    for endpoint in session.scalars(endpoints):
        endpoint.secret_encrypted = _rotated(box, endpoint.secret_encrypted, endpoint.id, result)
    trackers = (select(Tracker).where(Tracker.token_encrypted.is_not(None)).order_by(Tracker.id)
                .with_for_update(key_share=True))
    for tracker in session.scalars(trackers):
        assert tracker.token_encrypted is not None
        tracker.token_encrypted = _rotated(box, tracker.token_encrypted, tracker.id, result)
    return result


def _rotated(box: SecretBox, token: str, row_id: str, result: Rotation) -> str:
    """``token`` under the box's first key (as it is if it already is, or if no key reads it), counted."""
    if box.is_current(token):
        result.current += 1
        return token
    try:
        rotated = box.rotate(token)
    except SecretUnreadable:
        result.unreadable.append(row_id)
        return token
    result.rotated += 1
    return rotated
