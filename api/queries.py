"""Tenant-scoped lookups: the one place ownership is checked.

Every function is keyword-only and takes `tenant_id`; an object of another tenant is answered exactly
like a missing one (same 404 body), so nobody can probe for other tenants' ids. The task lookups also take
`tenant_id=None`: any tenant's, for the operator's reads (`Reader.tenant_id`, api/deps.py), which the routes
write to the audit log.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import not_found
from common.tables import File, Task, Trial, WebhookEndpoint

Lock = Literal["update", "share"] | None


def find_file(
    session: Session, *, tenant_id: str, file_id: str, include_deleted: bool = False, lock: Lock = None
) -> File | None:
    """`lock="share"` (task creation) and `lock="update"` (deletion) make those two wait for each other,
    while concurrent task creations on one file never block each other (no lock-order deadlocks)."""
    stmt = select(File).where(File.id == file_id, File.tenant_id == tenant_id)
    if not include_deleted:
        stmt = stmt.where(File.deleted_at.is_(None))
    if lock is not None:
        stmt = stmt.with_for_update(read=lock == "share", key_share=lock == "update")
    return session.scalar(stmt)


def get_file(session: Session, *, tenant_id: str, file_id: str, lock: Lock = None) -> File:
    file = find_file(session, tenant_id=tenant_id, file_id=file_id, lock=lock)
    if file is None:
        raise not_found("file", file_id)
    return file


def find_task(session: Session, *, tenant_id: str | None, task_id: str, lock: bool = False) -> Task | None:
    """`tenant_id=None`: a task of any tenant (the operator's read)."""
    stmt = select(Task).where(Task.id == task_id)
    if tenant_id is not None:
        stmt = stmt.where(Task.tenant_id == tenant_id)
    if lock:
        stmt = stmt.with_for_update(key_share=True)
    return session.scalar(stmt)


def get_task(session: Session, *, tenant_id: str | None, task_id: str, lock: bool = False) -> Task:
    task = find_task(session, tenant_id=tenant_id, task_id=task_id, lock=lock)
    if task is None:
        raise not_found("task", task_id)
    return task


def get_trial(session: Session, *, tenant_id: str | None, task_id: str, trial_id: str) -> Trial:
    """A trial of one of the tenant's tasks (of any task for `tenant_id=None`); a trial of another task answers
    404 too."""
    task = get_task(session, tenant_id=tenant_id, task_id=task_id)
    trial = session.scalar(
        select(Trial).where(Trial.id == trial_id, Trial.task_id == task_id, Trial.tenant_id == task.tenant_id)
    )
    if trial is None:
        raise not_found("trial", trial_id)
    return trial


def list_trials(session: Session, *, tenant_id: str | None, task_id: str) -> list[Trial]:
    task = get_task(session, tenant_id=tenant_id, task_id=task_id)
    stmt = select(Trial).where(Trial.task_id == task_id, Trial.tenant_id == task.tenant_id).order_by(Trial.index)
    return list(session.scalars(stmt))


def get_webhook(session: Session, *, tenant_id: str, webhook_id: str) -> WebhookEndpoint:
    endpoint = session.scalar(
        select(WebhookEndpoint).where(WebhookEndpoint.id == webhook_id, WebhookEndpoint.tenant_id == tenant_id)
    )
    if endpoint is None:
        raise not_found("webhook", webhook_id)
    return endpoint
