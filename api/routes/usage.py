"""Usage per tenant: `GET /v1/usage` (the caller's tenant) and `GET /v1/admin/usage` (every tenant)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select

from api.deps import AdminDep, SessionDep, TenantDep
from api.errors import invalid
from api.schemas.common import error_responses
from api.schemas.usage import UsageList, UsageOut
from common.tables import Tenant, utcnow
from common.usage import Usage, tenant_usage

router = APIRouter(prefix="/usage", tags=["usage"], responses=error_responses(401))
admin_router = APIRouter(prefix="/admin/usage", tags=["admin"], dependencies=[AdminDep],
                         responses=error_responses(401, 403))

From = Annotated[datetime | None, Query(alias="from", description="Window start (ISO 8601; no zone: UTC).")]
To = Annotated[datetime | None, Query(alias="to", description="Window end (ISO 8601; no zone: UTC); default now.")]


def _window(start: datetime | None, end: datetime | None) -> tuple[datetime | None, datetime]:
    def utc(x: datetime) -> datetime:
        return x.replace(tzinfo=UTC) if x.tzinfo is None else x.astimezone(UTC)

    start = utc(start) if start is not None else None
    end = utc(end) if end is not None else utcnow()
    if start is not None and start >= end:
        raise invalid("'from' must be before 'to'.", param="from")
    return start, end


def _out(tenant_id: str, usage: Usage, window: tuple[datetime | None, datetime]) -> UsageOut:
    return UsageOut(tenant_id=tenant_id, start=window[0], end=window[1], gpu_seconds=usage.gpu_seconds,
                    tokens=usage.tokens, trials=usage.trials, storage_bytes=usage.storage_bytes,
                    checkpoint_bytes=usage.checkpoint_bytes, sampling_tokens=usage.sampling_tokens)


@router.get("")
def read_usage(session: SessionDep, tenant: TenantDep, start: From = None, end: To = None) -> UsageOut:
    """The caller's tenant's usage in [from, to)."""
    window = _window(start, end)
    usage = tenant_usage(session, window, [tenant.id], now=window[1])[tenant.id]
    return _out(tenant.id, usage, window)


@admin_router.get("")
def read_all_usage(session: SessionDep, start: From = None, end: To = None) -> UsageList:
    """Every tenant's usage in [from, to), tenants in id order (those with none show zeros)."""
    window = _window(start, end)
    tenant_ids = sorted(session.scalars(select(Tenant.id)))
    usage = tenant_usage(session, window, tenant_ids, now=window[1])
    return UsageList(data=[_out(t, usage[t], window) for t in tenant_ids])
