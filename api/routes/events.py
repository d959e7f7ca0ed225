"""A task's events: cursor-paged, or streamed as Server-Sent Events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.deps import ReaderDep, SessionDep
from api.errors import invalid
from api.queries import get_task
from api.schemas.common import INT64_MAX, PathId, error_responses
from api.schemas.events import EventOut, EventPage
from api.services.audit import audit_read
from api.sse import event_stream
from common.tables import Event

router = APIRouter(prefix="/tasks/{task_id}/events", tags=["events"], responses=error_responses(401, 403, 404, 422))

After = Annotated[
    int | None, Query(ge=0, le=INT64_MAX, description="Only events with a larger id (the last id you saw).")
]
# ASCII digits only: str.isdigit() also takes '²', which int() then refuses (a 500 before), or '٣'.
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=19, pattern="^[0-9]*$")]


def resume_after(after: int | None, last_event_id: str | None) -> int:
    """The event id a stream starts after: `Last-Event-ID` (sent by a reconnecting browser) wins over `after`.

    An empty header is ignored: a browser sends the last id it saw, which may be none. Any other value that is
    not an event id is a 422 in the one error shape (its digits are checked by LastEventId), not a stream
    resumed from a guessed place.
    """
    if not last_event_id:
        return after or 0
    if int(last_event_id) > INT64_MAX:
        raise invalid("Last-Event-ID must be an event id (at most 2^63-1).", param="Last-Event-ID")
    return int(last_event_id)


@router.get("")
def list_events(
    task_id: PathId,
    reader: ReaderDep,
    session: SessionDep,
    request: Request,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    """Events in the order they happened; pass `next_after` back as `after` for the next page."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=task_id)
    stmt = select(Event).where(Event.task_id == task.id, Event.tenant_id == task.tenant_id)
    if after is not None:
        stmt = stmt.where(Event.id > after)
    rows = session.scalars(stmt.order_by(Event.id).limit(limit + 1)).all()
    data = [EventOut.of(e) for e in rows[:limit]]
    page = EventPage(data=data, has_more=len(rows) > limit, next_after=data[-1].id if data else after)
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return page


@router.get(
    "/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "One SSE block per event, then `end`."}},
)
def stream_events(
    task_id: PathId,
    reader: ReaderDep,
    session: SessionDep,
    request: Request,
    after: After = None,
    last_event_id: LastEventId = None,
) -> StreamingResponse:
    """Live events; resumes after `Last-Event-ID` (sent by browsers on reconnect) or `after`. Ends with an `error`
    block (code `api_key_revoked`) within about a second when the key is revoked or its tenant deleted. The admin
    token streams any tenant's task; the audit log gets one row per stream opened."""
    task = get_task(session, tenant_id=reader.tenant_id, task_id=task_id)  # a 404 now, before the stream starts
    start = resume_after(after, last_event_id)  # a 422 now too: nothing can answer one once the stream started
    audit_read(session, reader, request, tenant_id=task.tenant_id, resource_id=task.id)
    return StreamingResponse(
        event_stream(task.tenant_id, task.id, start, reader.key_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
