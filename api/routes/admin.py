"""Operator endpoints (admin token): tenants, API keys, workers."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Query, status
from sqlalchemy import select

from api.db import bad_cursor, commit, newest_first
from api.deps import AdminDep, SessionDep, hash_api_key
from api.errors import ApiError, conflict, not_found
from api.schemas.admin import ApiKeyCreate, ApiKeyCreated, ApiKeyOut, TenantCreate, TenantOut, TenantUpdate, WorkerOut
from api.schemas.common import ListPage, PathId, error_responses, id_query
from common.models import ApiKey, Tenant, Worker, new_id, utcnow
from common.settings import get_settings

router = APIRouter(
    prefix="/admin", tags=["admin"], dependencies=[AdminDep], responses=error_responses(401, 403, 404, 422)
)

KEY_PREFIX_CHARS = 12  # "lp_" + 9 characters: enough to tell keys apart in a list, useless to an attacker


def _tenant(session: SessionDep, tenant_id: str) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise not_found("tenant", tenant_id)
    return tenant


def _name_taken(name: str) -> ApiError:
    return conflict("tenant_exists", f"A tenant named '{name}' already exists.", param="name")


@router.post("/tenants", status_code=status.HTTP_201_CREATED, responses=error_responses(409))
def create_tenant(body: TenantCreate, session: SessionDep) -> TenantOut:
    settings = get_settings()
    if session.scalar(select(Tenant.id).where(Tenant.name == body.name)):
        raise _name_taken(body.name)
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
) -> ListPage[TenantOut]:
    cursor = None
    if after is not None and (cursor := session.get(Tenant, after)) is None:
        raise bad_cursor("tenant", after)
    rows, has_more = newest_first(session, select(Tenant), Tenant, after=cursor, limit=limit)
    return ListPage(data=[TenantOut.of(t) for t in rows], has_more=has_more)


@router.get("/tenants/{tenant_id}")
def get_tenant(tenant_id: PathId, session: SessionDep) -> TenantOut:
    return TenantOut.of(_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}", responses=error_responses(409))
def update_tenant(tenant_id: PathId, body: TenantUpdate, session: SessionDep) -> TenantOut:
    tenant = _tenant(session, tenant_id)
    changes = body.model_dump(exclude_unset=True, exclude_none=True)
    name = changes.get("name")
    if name and name != tenant.name and session.scalar(select(Tenant.id).where(Tenant.name == name)):
        raise _name_taken(name)
    for field, value in changes.items():
        setattr(tenant, field, value)
    commit(session, conflict_code="tenant_exists", conflict_message=f"A tenant named '{name}' already exists.")
    return TenantOut.of(tenant)


@router.post("/tenants/{tenant_id}/api-keys", status_code=status.HTTP_201_CREATED)
def create_api_key(tenant_id: PathId, session: SessionDep, body: ApiKeyCreate | None = None) -> ApiKeyCreated:
    """The key is in this response only; the server keeps its sha256."""
    tenant = _tenant(session, tenant_id)
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
    tenant = _tenant(session, tenant_id)
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
