"""The calling tenant's webhook endpoints and their delivery logs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status
from sqlalchemy import select

from api.db import bad_cursor, newest_first
from api.deps import EgressDep, SessionDep, TenantDep
from api.queries import get_webhook
from api.schemas.common import ListPage, PathId, error_responses, id_query
from api.schemas.webhooks import DeliveryOut, WebhookCreate, WebhookCreated, WebhookDeleted, WebhookOut
from api.services.webhooks import MAX_WEBHOOKS_PER_TENANT, create_webhook, delete_webhook
from common.tables import WebhookDelivery, WebhookEndpoint

router = APIRouter(prefix="/webhooks", tags=["webhooks"], responses=error_responses(401, 404, 422))


@router.post("", status_code=status.HTTP_201_CREATED, responses=error_responses(409))
def register_webhook(body: WebhookCreate, tenant: TenantDep, session: SessionDep, egress: EgressDep) -> WebhookCreated:
    """Registers an endpoint for the tenant's `task.succeeded`, `task.failed`, `task.cancelled` and
    `trial.completed` events (or the `events` given). The answer carries the signing `secret`, the only time it
    is shown. 422 `url_not_allowed`: the host resolves to an address that is not public (loopback, private,
    link-local, ...); `url_unresolvable`: it does not resolve. 409: the tenant has the most webhooks it may have."""
    endpoint, secret = create_webhook(session, tenant=tenant, body=body, egress=egress)
    return WebhookCreated.issued(endpoint, secret)


@router.get("")
def list_webhooks(tenant: TenantDep, session: SessionDep) -> ListPage[WebhookOut]:
    """This tenant's webhooks, newest first (all of them: a tenant has at most a few)."""
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant.id)
    rows, has_more = newest_first(session, stmt, WebhookEndpoint, after=None, limit=MAX_WEBHOOKS_PER_TENANT)
    return ListPage(data=[WebhookOut.of(e) for e in rows], has_more=has_more)


@router.get("/{webhook_id}")
def read_webhook(webhook_id: PathId, tenant: TenantDep, session: SessionDep) -> WebhookOut:
    return WebhookOut.of(get_webhook(session, tenant_id=tenant.id, webhook_id=webhook_id))


@router.delete("/{webhook_id}")
def remove_webhook(webhook_id: PathId, tenant: TenantDep, session: SessionDep) -> WebhookDeleted:
    """Removes the webhook with its delivery log; what was not delivered yet is not sent."""
    delete_webhook(session, tenant=tenant, webhook_id=webhook_id)
    return WebhookDeleted(id=webhook_id)


@router.get("/{webhook_id}/deliveries")
def list_deliveries(
    webhook_id: PathId,
    tenant: TenantDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, id_query("The id of the last delivery of the previous page.")] = None,
) -> ListPage[DeliveryOut]:
    """The webhook's deliveries, newest first: attempts, the last answer or error, the next try, when delivered."""
    endpoint = get_webhook(session, tenant_id=tenant.id, webhook_id=webhook_id)
    stmt = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id)
    cursor = None
    if after is not None:
        cursor = session.scalar(stmt.where(WebhookDelivery.id == after))
        if cursor is None:
            raise bad_cursor("delivery", after)
    rows, has_more = newest_first(session, stmt, WebhookDelivery, after=cursor, limit=limit)
    return ListPage(data=[DeliveryOut.of(d) for d in rows], has_more=has_more)
