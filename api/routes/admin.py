"""Operator endpoints (admin token): tenants, API keys, workers, the audit log of reads of tenants' data.

A deleted tenant (`deleted_at` set; api/services/tenants.py) reads as missing here (404), except in the list
with `include_deleted=true`; it keeps its name, so creating or renaming a tenant to that name is a 409."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Query, status
from sqlalchemy import select

from api.db import bad_cursor, commit, newest_first
from api.deps import AdminDep, SessionDep, hash_api_key
from api.errors import ApiError, conflict, not_found
from api.schemas.admin import (
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyOut,
    AuditEntryOut,
    TenantCreate,
    TenantOut,
    TenantUpdate,
    WorkerOut,
)
from api.schemas.common import ListPage, PathId, error_responses, id_query
from api.services import tenants
from common.settings import get_settings
from common.tables import ApiKey, AuditEntry, Tenant, Worker, new_id, utcnow

router = APIRouter(
    prefix="/admin", tags=["admin"], dependencies=[AdminDep], responses=error_responses(401, 403, 404, 422)
)

KEY_PREFIX_CHARS = 12  # "lp_" + 9 characters: enough to tell keys apart in a list, useless to an attacker


def _name_taken(session: SessionDep, name: str) -> ApiError | None:
    """The 409 for a name another tenant holds, a deleted one included (names are unique: they are not reused)."""
    deleted_at = session.execute(select(Tenant.deleted_at).where(Tenant.name == name)).one_or_none()
    if deleted_at is None:
        return None
    if deleted_at[0] is not None:
        return conflict("tenant_exists", f"A deleted tenant is named '{name}'; names are not reused.", param="name")
    return conflict("tenant_exists", f"A tenant named '{name}' already exists.", param="name")


@router.post("/tenants", status_code=status.HTTP_201_CREATED, responses=error_responses(409))
def create_tenant(body: TenantCreate, session: SessionDep) -> TenantOut:
    settings = get_settings()
    if taken := _name_taken(session, body.name):
        raise taken
    tenant = Tenant(
        id=new_id("tenant"),
        name=body.name,
        weight=body.weight,
        max_concurrent_trials=body.max_concurrent_trials or settings.default_max_concurrent_trials,
        max_trials_per_task=body.max_trials_per_task or settings.default_max_trials_per_task,
        max_file_bytes=body.max_file_bytes or settings.default_max_file_bytes,
        max_storage_bytes=body.max_storage_bytes or settings.default_max_storage_bytes,
        max_files=body.max_files or settings.default_max_files,
        created_at=utcnow(),
    )
    session.add(tenant)
    commit(session, conflict_code="tenant_exists", conflict_message=f"A tenant named '{body.name}' already exists.")
    return TenantOut.of(tenant)


@router.get("/tenants")
def list_tenants(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, id_query("The id of the last tenant of the previous page.")] = None,
    include_deleted: Annotated[bool, Query(description="Also the deleted tenants (deleted_at set).")] = False,
) -> ListPage[TenantOut]:
    cursor = None
    if after is not None and (cursor := session.get(Tenant, after)) is None:
        raise bad_cursor("tenant", after)
    stmt = select(Tenant) if include_deleted else select(Tenant).where(Tenant.deleted_at.is_(None))
    rows, has_more = newest_first(session, stmt, Tenant, after=cursor, limit=limit)
    return ListPage(data=[TenantOut.of(t) for t in rows], has_more=has_more)


@router.get("/tenants/{tenant_id}")
def get_tenant(tenant_id: PathId, session: SessionDep) -> TenantOut:
    """A deleted tenant is a 404 (the list shows it with include_deleted=true)."""
    return TenantOut.of(tenants.live_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}", responses=error_responses(409))
def update_tenant(tenant_id: PathId, body: TenantUpdate, session: SessionDep) -> TenantOut:
    tenant = tenants.live_tenant(session, tenant_id)
    changes = body.model_dump(exclude_unset=True, exclude_none=True)
    name = changes.get("name")
    if name and name != tenant.name and (taken := _name_taken(session, name)):
        raise taken
    for field, value in changes.items():
        setattr(tenant, field, value)
    commit(session, conflict_code="tenant_exists", conflict_message=f"A tenant named '{name}' already exists.")
    return TenantOut.of(tenant)


@router.delete("/tenants/{tenant_id}")
def delete_tenant(tenant_id: PathId, session: SessionDep) -> TenantOut:
    """Delete the tenant: its API keys are revoked at once (its open event streams end within about a second),
    its queued and running tasks cancelled (running trials are stopped), its webhooks removed with their
    deliveries. Kept, for billing and audit: the tenant (shown with `deleted_at` by the list's
    include_deleted=true), its finished tasks, events, usage, files and adapters, and its name, which no other
    tenant can take. 404 for a missing or already deleted tenant."""
    return TenantOut.of(tenants.delete_tenant(session, tenant_id))


@router.post("/tenants/{tenant_id}/api-keys", status_code=status.HTTP_201_CREATED)
def create_api_key(tenant_id: PathId, session: SessionDep, body: ApiKeyCreate | None = None) -> ApiKeyCreated:
    """The key is in this response only; the server keeps its sha256."""
    tenant = tenants.live_tenant(session, tenant_id, lock=True)  # locked: deletion waits, or this finds it deleted
    key = "lp_" + secrets.token_urlsafe(32)
    row = ApiKey(
        id=new_id("key"), tenant_id=tenant.id, name=(body.name if body else ""), prefix=key[:KEY_PREFIX_CHARS],
        key_hash=hash_api_key(key), created_at=utcnow(),
    )
    session.add(row)
    commit(session)
    return ApiKeyCreated(**ApiKeyOut.of(row).model_dump(), key=key)


@router.get("/tenants/{tenant_id}/api-keys")
def list_api_keys(tenant_id: PathId, session: SessionDep) -> ListPage[ApiKeyOut]:
    tenant = tenants.live_tenant(session, tenant_id)
    keys = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.created_at, ApiKey.id))
    return ListPage(data=[ApiKeyOut.of(k) for k in keys])


@router.delete("/api-keys/{key_id}")
def revoke_api_key(key_id: PathId, session: SessionDep) -> ApiKeyOut:
    """Revokes the key at once (idempotent: revoking a revoked key changes nothing)."""
    key = session.get(ApiKey, key_id)
    if key is None:
        raise not_found("api_key", key_id)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        commit(session)
    return ApiKeyOut.of(key)


@router.get("/workers")
def list_workers(session: SessionDep) -> ListPage[WorkerOut]:
    workers = session.scalars(select(Worker).order_by(Worker.registered_at, Worker.id))
    return ListPage(data=[WorkerOut.of(w) for w in workers])


@router.delete("/workers/{worker_id}/quarantine")
def lift_worker_quarantine(worker_id: PathId, session: SessionDep) -> WorkerOut:
    """Ends the worker's quarantine now (idempotent) and clears its record of lost packs: the scheduler may give it
    packs from its next round. For an operator who fixed the cause (a bad host, a broken model directory)."""
    worker = session.get(Worker, worker_id)
    if worker is None:
        raise not_found("worker", worker_id)
    if worker.quarantined_until is not None or worker.lost_packs or worker.quarantines:
        worker.quarantined_until, worker.lost_packs, worker.quarantines = None, None, 0
        commit(session)
    return WorkerOut.of(worker)


@router.get("/audit")
def list_audit_entries(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, id_query("The id of the last entry of the previous page.")] = None,
    tenant_id: Annotated[str | None, id_query("Only reads of this tenant's data.")] = None,
) -> ListPage[AuditEntryOut]:
    """The operator's reads of tenants' tasks, trials, curves and events (one row per request, one per event stream
    opened), newest first. Reading this log is not itself logged."""
    cursor = None
    if after is not None and (cursor := session.get(AuditEntry, after)) is None:
        raise bad_cursor("audit entry", after)
    stmt = select(AuditEntry) if tenant_id is None else select(AuditEntry).where(AuditEntry.tenant_id == tenant_id)
    rows, has_more = newest_first(session, stmt, AuditEntry, after=cursor, limit=limit)
    return ListPage(data=[AuditEntryOut.of(e) for e in rows], has_more=has_more)
