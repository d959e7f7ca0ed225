"""Registering and removing a tenant's webhook endpoints (the sender is scheduler/service/webhooks.py)."""

from __future__ import annotations

import logging
import re
import secrets
from urllib.parse import urlsplit

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.db import commit
from api.deps import invalid_api_key
from api.errors import conflict, invalid
from api.queries import get_webhook
from api.schemas.common import NO_CONTROL_CHARS
from api.schemas.webhooks import WebhookCreate
from common.egress import NOT_ALLOWED, Egress, EgressRefused, authority_refusal
from common.secret_box import get_secret_box
from common.tables import Tenant, WebhookEndpoint, new_id, utcnow
from common.webhooks import WEBHOOK_EVENTS

log = logging.getLogger(__name__)

MAX_WEBHOOKS_PER_TENANT = 20  # every matching event is sent to each: a bound on what one event costs the sender


def check_url(url: str, param: str = "url") -> str:
    """An absolute http(s) URL with a host, that httpx will send to; anything else is a 422 on `param`."""
    def refuse(why: str) -> Exception:
        return invalid(f"{param}: {why}", param=param, code="invalid_url")

    if not re.match(NO_CONTROL_CHARS, url) or any(c.isspace() for c in url):
        raise refuse("must not contain spaces or control characters.")
    if (ambiguous := authority_refusal(url)) is not None:
        raise refuse(f"the part before the path (user, password, host, port) holds {ambiguous}, which URL parsers read "
                     "differently; write the host plainly (an international name in its xn-- form), with no escaped "
                     "user or password, e.g. https://hooks.example.com/loraplane.")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise refuse(f"not a valid URL ({exc}).") from exc
    if parts.scheme.lower() not in ("http", "https"):
        raise refuse("must be an http or https URL.")
    if not parts.hostname:
        raise refuse("must name a host.")
    return url


def check_reachable(url: str, egress: Egress, param: str = "url", what: str = "webhooks are sent") -> None:
    """The URL's host resolves, and to public addresses only (or ones the operator allows): every address is
    checked (common/egress.py); nothing is connected to. The tenant hears which rule, never the addresses its
    name resolved to (those are the operator's, in the log)."""
    try:
        egress.target(url)
    except EgressRefused as exc:
        log.info("outbound URL %s refused: %s", url, exc)
        if exc.code == NOT_ALLOWED:
            raise invalid(f"{param}: the host is not a public address; {what} to public addresses only.",
                          param=param, code=exc.code) from None
        raise invalid(f"{param}: the host name does not resolve (checked now and at each connection).",
                      param=param, code=exc.code) from None


def create_webhook(session: Session, *, tenant: Tenant, body: WebhookCreate,
                   egress: Egress) -> tuple[WebhookEndpoint, str]:
    """The new endpoint and its signing secret in plaintext, for the one answer that shows it; the row keeps it
    encrypted. Resolution runs before the tenant's row is locked: a slow lookup holds no lock."""
    url = check_url(body.url)
    check_reachable(url, egress)
    events = [e for e in WEBHOOK_EVENTS if body.events is None or e in body.events]  # deduplicated, in one order
    # The tenant's row lock makes concurrent registrations count one after the other (no limit overrun), and
    # orders this one against the tenant's deletion (api/services/tenants.py), which takes the same lock and removes
    # the tenant's webhooks: one that authenticated just before it must not leave an endpoint behind.
    deleted_at = select(Tenant.deleted_at).where(Tenant.id == tenant.id).with_for_update(key_share=True)
    if session.scalar(deleted_at) is not None:
        raise invalid_api_key()
    count = session.scalar(select(func.count()).select_from(WebhookEndpoint)
                           .where(WebhookEndpoint.tenant_id == tenant.id)) or 0
    if count >= MAX_WEBHOOKS_PER_TENANT:
        raise conflict("webhook_limit_reached", f"A tenant may register at most {MAX_WEBHOOKS_PER_TENANT} webhooks; "
                                                "delete one first.")
    secret = f"whsec_{secrets.token_urlsafe(32)}"
    endpoint = WebhookEndpoint(id=new_id("wh"), tenant_id=tenant.id, url=url, events=events,
                               description=body.description, secret_encrypted=get_secret_box().encrypt(secret),
                               created_at=utcnow())
    session.add(endpoint)
    commit(session)
    return endpoint, secret


def delete_webhook(session: Session, *, tenant: Tenant, webhook_id: str) -> None:
    """Removes the endpoint and its delivery log; deliveries not yet sent are not sent."""
    session.delete(get_webhook(session, tenant_id=tenant.id, webhook_id=webhook_id))
    commit(session)
