"""A task's events: cursor-paged, or streamed as Server-Sent Events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.deps import SessionDep, TenantDep
from api.errors import invalid
from api.queries import get_task
from api.schemas.common import error_responses
from api.schemas.events import EventOut, EventPage
from api.sse import event_stream
from common.models import Event

router = APIRouter(prefix="/tasks/{task_id}/events", tags=["events"], responses=error_responses(401, 404, 422))

After = Annotated[int | None, Query(ge=0, description="Only events with a larger id (the last id you saw).")]


@router.get("")
def list_events(
    task_id: str,
    tenant: TenantDep,
    session: SessionDep,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    """Events in the order they happened; pass `next_after` back as `after` for the next page."""
    task = get_task(session, tenant_id=tenant.id, task_id=task_id)
    stmt = select(Event).where(Event.task_id == task.id, Event.tenant_id == tenant.id)
    if after is not None:
        stmt = stmt.where(Event.id > after)
    rows = session.scalars(stmt.order_by(Event.id).limit(limit + 1)).all()
    data = [EventOut.of(e) for e in rows[:limit]]
    return EventPage(data=data, has_more=len(rows) > limit, next_after=data[-1].id if data else after)


@router.get(
    "/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "One SSE block per event, then `end`."}},
)
def stream_events(
    task_id: str,
    tenant: TenantDep,
    session: SessionDep,
    after: After = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    """Live events; resumes after `Last-Event-ID` (sent by browsers on reconnect) or `after`."""
    task = get_task(session, tenant_id=tenant.id, task_id=task_id)  # a 404 now, before the stream starts
    start = after or 0
    if last_event_id:
        if not last_event_id.isdigit():
            raise invalid("Last-Event-ID must be an event id.", param="Last-Event-ID")
        start = int(last_event_id)
    return StreamingResponse(
        event_stream(tenant.id, task.id, start),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
