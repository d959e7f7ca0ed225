"""The Server-Sent Events stream of a task's events.

It reads the database (the system of record) rather than the bus, so a reconnecting client resumes
exactly where it left off (`Last-Event-ID`) and a Redis outage loses nothing.

An open stream holds no thread and no database connection: it is a coroutine that waits on its process's
`TaskWatch`. Every `POLL_S` the watch reads, in one worker thread and one query, the state and the newest
event id of every task that has a stream open in this process, so a hundred idle streams cost one small
query per tick, not a hundred pairs. A stream reads its own events (a short query in a worker thread) only
when the watch saw an event it has not sent, or a final state.

Wire format, one block per event, then a final `end` once the task is final and every event was sent:

    id: 42
    event: trial.completed
    data: {"id": 42, "object": "event", ...}

    event: end
    data: {"task_id": "task-...", "state": "succeeded"}
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
from anyio.lowlevel import RunVar
from sqlalchemy import bindparam, func, select

from api.db import session_factory
from api.schemas.events import EventOut
from common.db import get_autocommit_engine
from common.models import Event, Task
from common.states import TASK_FINAL

log = logging.getLogger(__name__)

POLL_S = 0.5  # between the watch's database reads
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream
BATCH = 500  # events per read; a full batch is followed at once by the next read


@dataclass(frozen=True)
class TaskNow:
    state: str | None  # None: there is no such task (any more)
    newest_event: int  # 0 while it has none


# The newest event id by the (task_id, id) index, per watched task; a task that is gone is missing.
_TASKS_NOW = select(
    Task.id, Task.state, select(func.max(Event.id)).where(Event.task_id == Task.id).scalar_subquery()
).where(Task.id.in_(bindparam("task_ids", expanding=True)))


def read_tasks_now(task_ids: Sequence[str]) -> dict[str, TaskNow]:
    found = {task_id: TaskNow(state=None, newest_event=0) for task_id in task_ids}
    with get_autocommit_engine().connect() as conn:
        for task_id, state, newest_event in conn.execute(_TASKS_NOW, {"task_ids": list(task_ids)}):
            found[task_id] = TaskNow(state=state, newest_event=newest_event or 0)
    return found


class TaskWatch:
    """What the tasks with open streams look like now, read for all of them at once.

    One per event loop (a server process has one); it runs only while a stream is open. Everything here
    happens on that loop, so the counters need no lock.
    """

    def __init__(self) -> None:
        self._streams: Counter[str] = Counter()  # task id -> open streams
        self._now: dict[str, TaskNow] = {}
        self._ticked = asyncio.Event()  # replaced by a fresh one after every read
        self._runner: asyncio.Task[None] | None = None

    @contextmanager
    def watching(self, task_id: str) -> Iterator[None]:
        self._streams[task_id] += 1
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run(), name="sse-task-watch")
        try:
            yield
        finally:
            self._streams[task_id] -= 1
            if not self._streams[task_id]:
                del self._streams[task_id]

    async def next_tick(self, task_id: str, timeout: float) -> TaskNow | None:
        """After the next read (or `timeout`), the task as last read; None until a read included it."""
        with anyio.move_on_after(timeout):
            await self._ticked.wait()
        return self._now.get(task_id)

    async def _run(self) -> None:
        try:
            while self._streams:
                try:
                    self._now = await anyio.to_thread.run_sync(read_tasks_now, list(self._streams))
                except Exception:  # noqa: BLE001 - a database outage: streams wait (with keep-alives) for the next read
                    log.warning("reading the watched tasks failed; retrying in %ss", POLL_S, exc_info=True)
                else:
                    ticked, self._ticked = self._ticked, asyncio.Event()
                    ticked.set()
                await asyncio.sleep(POLL_S)
        finally:
            self._runner = None  # the next stream to open starts a new runner


_TASK_WATCH: RunVar[TaskWatch] = RunVar("sse_task_watch")


def task_watch() -> TaskWatch:
    """This event loop's watch (a process has one loop; tests start one per app)."""
    try:
        return _TASK_WATCH.get()
    except LookupError:
        watch = TaskWatch()
        _TASK_WATCH.set(watch)
        return watch


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


def _worth_reading(now: TaskNow | None, after: int) -> bool:
    return now is not None and (now.newest_event > after or now.state is None or now.state in TASK_FINAL)


async def event_stream(tenant_id: str, task_id: str, after: int) -> AsyncIterator[str]:
    watch = task_watch()
    last_write = time.monotonic()
    with watch.watching(task_id):
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
            while not _worth_reading(await watch.next_tick(task_id, KEEPALIVE_S), after):
                if time.monotonic() - last_write >= KEEPALIVE_S:
                    yield ": keep-alive\n\n"
                    last_write = time.monotonic()
