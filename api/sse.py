"""The Server-Sent Events stream of a task's events.

It polls the database (the system of record) rather than the bus, so a reconnecting client resumes
exactly where it left off (`Last-Event-ID`) and a Redis outage loses nothing. Each poll opens a fresh
short session in a worker thread; no session or connection is held across the sleeps.

Wire format, one block per event, then a final `end` once the task is final and every event was sent:

    id: 42
    event: trial.completed
    data: {"id": 42, "object": "event", ...}

    event: end
    data: {"task_id": "task-...", "state": "succeeded"}
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
from sqlalchemy import select

from api.db import session_factory
from api.schemas.events import EventOut
from common.models import Event, Task
from common.states import TASK_FINAL

POLL_S = 0.5  # between database polls while nothing new arrives
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream
BATCH = 500  # events per poll; a full batch is followed at once by the next poll


def poll(tenant_id: str, task_id: str, after: int) -> tuple[list[EventOut], str | None]:
    """(events after `after`, the task's state) — the state is read first, so a final state read here
    guarantees that every event written before the task became final is in this or an earlier batch."""
    with session_factory()() as session:
        state = session.scalar(select(Task.state).where(Task.id == task_id, Task.tenant_id == tenant_id))
        rows = session.scalars(
            select(Event)
            .where(Event.task_id == task_id, Event.tenant_id == tenant_id, Event.id > after)
            .order_by(Event.id)
            .limit(BATCH)
        )
        return [EventOut.of(e) for e in rows], state


def format_event(event: EventOut) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"


async def event_stream(tenant_id: str, task_id: str, after: int) -> AsyncIterator[str]:
    last_write = time.monotonic()
    while True:
        events, state = await anyio.to_thread.run_sync(poll, tenant_id, task_id, after)
        for event in events:
            yield format_event(event)
            after = event.id
        if events:
            last_write = time.monotonic()
        if len(events) == BATCH:
            continue  # more are waiting
        if state is None or state in TASK_FINAL:  # None: the task was removed while streaming
            yield f"event: end\ndata: {json.dumps({'task_id': task_id, 'state': state})}\n\n"
            return
        if time.monotonic() - last_write >= KEEPALIVE_S:
            yield ": keep-alive\n\n"
            last_write = time.monotonic()
        await anyio.sleep(POLL_S)
