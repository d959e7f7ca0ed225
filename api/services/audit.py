"""The audit log: every read of a tenant's data by the operator (the admin token on a task, trials, curves or
events route) writes one row, committed before the answer is sent. `GET /v1/admin/audit` reads the log.

A tenant's own reads write nothing. A read that found nothing (404) writes nothing: no tenant's data was read.
An event stream writes one row when it opens, however long it stays open. A poll is a read: a dashboard page the
operator leaves open on a running task writes a row per request it sends.
"""

from __future__ import annotations

from fastapi import Request
from sqlalchemy.orm import Session

from api.deps import Reader
from api.telemetry import route_label
from common.tables import AuditEntry, new_id, utcnow


def audit_read(
    session: Session, reader: Reader, request: Request, *, tenant_id: str | None, resource_id: str | None
) -> None:
    """Writes the operator's read of `tenant_id`'s data (None: a list across every tenant) to the log; nothing for
    a tenant reading its own. `resource_id`: the most specific object read (the trial, else the task)."""
    if reader.actor is None:
        return
    session.add(AuditEntry(
        id=new_id("audit"), actor=reader.actor, method=request.method, route=route_label(request.scope),
        tenant_id=tenant_id, resource_id=resource_id, created_at=utcnow(),
    ))
    session.commit()
