"""Webhook endpoints and their delivery log."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from api.schemas.common import RequestModel, Text, UtcDateTime
from common.tables import WebhookDelivery, WebhookEndpoint
from common.webhooks import DELIVERY_PENDING

WebhookEventType = Literal["task.succeeded", "task.failed", "task.cancelled", "trial.completed"]
URL_MAX_LENGTH = 2000  # webhook_endpoints.url


class WebhookCreate(RequestModel):
    url: Annotated[str, StringConstraints(min_length=1, max_length=URL_MAX_LENGTH)] = Field(
        description="Where deliveries are POSTed: an http or https URL whose host resolves to public addresses "
                    "only (checked now and at each delivery; the operator may allow more).")
    events: Annotated[list[WebhookEventType], Field(min_length=1, max_length=20)] | None = Field(
        default=None, description="The event types sent to it; all of them when left out.")
    description: Annotated[Text, StringConstraints(max_length=500)] = ""


class WebhookOut(BaseModel):
    id: str
    object: Literal["webhook"] = "webhook"
    url: str
    events: list[str]
    description: str
    created_at: UtcDateTime

    @classmethod
    def of(cls, e: WebhookEndpoint) -> WebhookOut:
        return cls(id=e.id, url=e.url, events=list(e.events), description=e.description, created_at=e.created_at)


class WebhookCreated(WebhookOut):
    secret: str = Field(description="The signing secret. Shown only in this answer: keep it now.")

    @classmethod
    def issued(cls, e: WebhookEndpoint, secret: str) -> WebhookCreated:
        """`secret`: as issued, in plaintext (the row keeps it encrypted)."""
        return cls(id=e.id, url=e.url, events=list(e.events), description=e.description, created_at=e.created_at,
                   secret=secret)


class WebhookDeleted(BaseModel):
    id: str
    object: Literal["webhook"] = "webhook"
    deleted: Literal[True] = True


class DeliveryOut(BaseModel):
    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    webhook_id: str
    event_id: int
    event_type: str
    state: str  # pending | delivered | failed
    attempts: int
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: UtcDateTime | None
    next_attempt_at: UtcDateTime | None  # None once delivered or failed
    delivered_at: UtcDateTime | None
    created_at: UtcDateTime

    @classmethod
    def of(cls, d: WebhookDelivery) -> DeliveryOut:
        next_at: datetime | None = d.next_attempt_at if d.state == DELIVERY_PENDING else None
        return cls(id=d.id, webhook_id=d.endpoint_id, event_id=d.event_id, event_type=d.event_type, state=d.state,
                   attempts=d.attempts, last_status_code=d.last_status_code, last_error=d.last_error,
                   last_attempt_at=d.last_attempt_at, next_attempt_at=next_at, delivered_at=d.delivered_at,
                   created_at=d.created_at)
