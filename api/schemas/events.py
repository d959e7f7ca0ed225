"""Task events: the user-visible log, paged by event id."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from api.schemas.common import UtcDateTime
from common.tables import Event


class EventOut(BaseModel):
    id: int
    object: Literal["event"] = "event"
    created_at: UtcDateTime
    type: str
    level: str
    message: str
    trial_id: str | None
    data: dict[str, Any]

    @classmethod
    def of(cls, e: Event) -> EventOut:
        return cls(
            id=e.id, created_at=e.created_at, type=e.type, level=e.level, message=e.message,
            trial_id=e.trial_id, data=e.data or {},
        )


class EventPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventOut]
    has_more: bool
    next_after: int | None
