"""Deleting a tenant (an operator's `DELETE /v1/admin/tenants/{id}`): soft, in one transaction.

What goes: every API key (revoked, so new requests are 401 at once and open event streams end at their watch's
next read, api/sse.py), every webhook endpoint with its delivery log (nothing more is sent; the signing secrets are
gone), and the unfinished tasks (cancelled as a tenant's own cancel does, so the scheduler stops their running
trials). What stays: the row (with `deleted_at`, and its name: names are unique, so a new tenant cannot take it),
finished tasks, events, usage records (billing: `GET /v1/admin/usage` still counts the tenant), files and
adapters in the artifact store.
"""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from api.db import commit
from api.errors import not_found
from api.services.tasks import cancel_unfinished
from common.bus import wake_scheduler
from common.states import TASK_FINAL
from common.tables import ApiKey, Task, Tenant, WebhookEndpoint, utcnow


def live_tenant(session: Session, tenant_id: str, *, lock: bool = False) -> Tenant:
    """The tenant; a deleted one reads as missing (404). `lock`: the row lock deletion takes (FOR NO KEY
    UPDATE), so a key created under it cannot outlive the deletion."""
    tenant = session.get(Tenant, tenant_id, with_for_update={"key_share": True} if lock else None,
                         populate_existing=lock)
    if tenant is None or tenant.deleted_at is not None:
        raise not_found("tenant", tenant_id)
    return tenant


def delete_tenant(session: Session, tenant_id: str) -> Tenant:
    """Deletes the tenant (404 for a missing or already deleted one) and returns it, `deleted_at` set."""
    # Locked first: a task submission, an upload or a new key waits for this transaction and then finds the
    # tenant deleted (they lock the same row).
    tenant = live_tenant(session, tenant_id, lock=True)
    now = utcnow()
    tenant.deleted_at = now
    session.execute(update(ApiKey).where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
                    .values(revoked_at=now))
    # Before the cancellations: their events then find no endpoint to enqueue a delivery for. The deliveries of
    # earlier events go with their endpoints (ON DELETE CASCADE).
    session.execute(delete(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant.id))
    tasks = session.scalars(select(Task).where(Task.tenant_id == tenant.id, Task.state.not_in(TASK_FINAL))
                            .order_by(Task.id).with_for_update(key_share=True)).all()
    cancel_unfinished(session, tasks, why="Task cancelled: its tenant was deleted")
    commit(session)
    if tasks:
        wake_scheduler("tenant.deleted", tenant_id=tenant.id)
    return tenant
