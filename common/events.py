"""Task events: the user-visible log of everything that happened to a task (stored in the database)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from common.models import Event


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
    return event
