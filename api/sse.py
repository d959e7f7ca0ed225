"""The Server-Sent Events stream of a task's events.

It reads the database (the system of record) rather than the bus, so a reconnecting client resumes
exactly where it left off (`Last-Event-ID`) and a Redis outage loses nothing.

An open stream holds no thread and no database connection: it is a coroutine that waits on its process's
`TaskWatch`. Every `POLL_S` the watch reads, in one worker thread and one query, the state and the newest
event id of every task that has a stream open in this process, and whether the API key each stream was
opened with still authenticates (not revoked, its tenant not deleted), so a hundred idle streams cost one
small query per tick, not a hundred pairs. A stream reads its own events (a short query in a worker thread)
only when the watch saw an event it has not sent, a final state, or its key no longer authenticating.

A stream whose key stops authenticating ends at the watch's next read (within about POLL_S plus the read, well
under 2 s; `tests/api/test_api_stream_revocation.py`) with a final `error` block in the API's one error shape,
even while events keep coming: the stream's own read of events checks the key in the same statement as the
task's state, so no event is read once the revocation is committed. Each process's watch reads the database,
which is the truth for every process of `loraplane api --workers N`.

Wire format, one block per event, then a final `end` once the task is final and every event was sent:

    id: 42
    event: trial.completed
    data: {"id": 42, "object": "event", ...}

    event: end
    data: {"task_id": "task-...", "state": "succeeded"}

A stream opened with the admin token (the operator reading a tenant's task) has no key to re-check (`key_id`
None): the admin token is the deployment's setting, which a running process does not change.

The same watch serves a sampling request in flight (api/services/completions.py): it watches the request's key
alone (`watching_key`), and the request checks `key_valid` while it waits for the sampler, so a completion whose key
is revoked (or whose tenant is deleted) is cut off as a stream is, in the same tick's read.

or, when the key was revoked (or its tenant deleted) while the stream was open:

    event: error
    data: {"error": {"type": "authentication_error", "code": "api_key_revoked", "message": "...", "param": null}}
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
from sqlalchemy import Exists, bindparam, func, literal, null, select, union_all

from api.db import session_factory
from api.errors import AUTHENTICATION, ApiError
from api.schemas.events import EventOut
from common.db import get_autocommit_engine
from common.states import TASK_FINAL
from common.tables import ApiKey, Event, Task, Tenant

log = logging.getLogger(__name__)

POLL_S = 0.5  # between the watch's database reads
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream
BATCH = 500  # events per read; a full batch is followed at once by the next read


@dataclass(frozen=True)
class TaskNow:
    state: str | None  # None: there is no such task (any more)
    newest_event: int  # 0 while it has none


@dataclass(frozen=True)
class WatchedNow:
    """One read of the watch: the tasks streamed, and whether each key the streams were opened with still
    authenticates."""

    tasks: dict[str, TaskNow]
    keys: dict[str, bool]  # key id -> not revoked and its tenant not deleted


_TASK, _KEY = "task", "key"
# One statement for both, so a tick is one round trip however many streams are open: a row per watched task (its
# newest event id by the (task_id, id) index; a task that is gone is missing) and a row per watched key that still
# authenticates (a revoked key, or one of a deleted tenant, is missing).
_WATCHED_NOW = union_all(
    select(literal(_TASK), Task.id, Task.state,
           select(func.max(Event.id)).where(Event.task_id == Task.id).scalar_subquery())
    .where(Task.id.in_(bindparam("task_ids", expanding=True))),
    select(literal(_KEY), ApiKey.id, null(), null())
    .join(Tenant, Tenant.id == ApiKey.tenant_id)
    .where(ApiKey.id.in_(bindparam("key_ids", expanding=True)), ApiKey.revoked_at.is_(None),
           Tenant.deleted_at.is_(None)),
)


def read_watched_now(task_ids: Sequence[str], key_ids: Sequence[str]) -> WatchedNow:
    tasks = {task_id: TaskNow(state=None, newest_event=0) for task_id in task_ids}
    keys = dict.fromkeys(key_ids, False)
    with get_autocommit_engine().connect() as conn:
        rows = conn.execute(_WATCHED_NOW, {"task_ids": list(task_ids), "key_ids": list(key_ids)})
        for kind, row_id, state, newest_event in rows:
            if kind == _TASK:
                tasks[row_id] = TaskNow(state=state, newest_event=newest_event or 0)
            else:
                keys[row_id] = True
    return WatchedNow(tasks=tasks, keys=keys)


class TaskWatch:
    """What the tasks with open streams look like now, read for all of them at once.

    One per event loop (a server process has one); it runs only while a stream or a sampling request is open.
    Everything here happens on that loop, so the counters need no lock.
    """

    def __init__(self) -> None:
        self._streams: Counter[str] = Counter()  # task id -> open streams
        self._keys: Counter[str] = Counter()  # API key id -> open streams and sampling requests
        self._now = WatchedNow(tasks={}, keys={})
        self._ticked = asyncio.Event()  # replaced by a fresh one after every read
        self._runner: asyncio.Task[None] | None = None

    @contextmanager
    def watching(self, task_id: str, key_id: str | None) -> Iterator[None]:
        """`key_id` None: the operator's stream, no key to watch."""
        with self._counted([(self._streams, task_id)] + ([(self._keys, key_id)] if key_id is not None else [])):
            yield

    @contextmanager
    def watching_key(self, key_id: str) -> Iterator[None]:
        """A key alone, no task: what a sampling request in flight watches (`key_valid` says when to cut it off)."""
        with self._counted([(self._keys, key_id)]):
            yield

    @contextmanager
    def _counted(self, watched: list[tuple[Counter[str], str]]) -> Iterator[None]:
        for counter, item in watched:
            counter[item] += 1
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run(), name="sse-task-watch")
        try:
            yield
        finally:
            for counter, item in watched:
                counter[item] -= 1
                if not counter[item]:
                    del counter[item]

    def key_valid(self, key_id: str | None) -> bool:
        """False once a read found the key revoked or its tenant deleted; True before a read included it (the
        key authenticated when its stream opened), and always for the operator's stream (None)."""
        return key_id is None or self._now.keys.get(key_id, True)

    async def next_tick(self, task_id: str, timeout: float) -> TaskNow | None:
        """After the next read (or `timeout`), the task as last read; None until a read included it."""
        with anyio.move_on_after(timeout):
            await self._ticked.wait()
        return self._now.tasks.get(task_id)

    async def _run(self) -> None:
        try:
            while self._streams or self._keys:
                try:
                    self._now = await anyio.to_thread.run_sync(read_watched_now, list(self._streams),
                                                               list(self._keys))
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


def _key_valid(key_id: str) -> Exists:
    return (select(ApiKey.id).join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None), Tenant.deleted_at.is_(None)).exists())


@dataclass(frozen=True)
class Polled:
    events: list[EventOut]
    state: str | None  # None: there is no such task (any more)
    key_valid: bool  # False: the stream's key was revoked or its tenant deleted; no events were read


def poll(tenant_id: str, task_id: str, after: int, key_id: str | None) -> Polled:
    """The events after `after` and the task's state, if the stream's key still authenticates (`key_id` None: the
    operator's stream, nothing to check). The state is read first, so a final state read here guarantees that
    every event written before the task became final is in this or an earlier batch; the key with it, so no event
    is read once the revocation is committed."""
    state_now = select(Task.state).where(Task.id == task_id, Task.tenant_id == tenant_id).scalar_subquery()
    key_check = literal(True) if key_id is None else _key_valid(key_id)
    with session_factory()() as session:
        state, key_valid = session.execute(select(state_now, key_check)).one()
        if not key_valid:
            return Polled(events=[], state=state, key_valid=False)
        rows = session.scalars(
            select(Event)
            .where(Event.task_id == task_id, Event.tenant_id == tenant_id, Event.id > after)
            .order_by(Event.id)
            .limit(BATCH)
        )
        return Polled(events=[EventOut.of(e) for e in rows], state=state, key_valid=True)


def format_event(event: EventOut) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"


def _worth_reading(now: TaskNow | None, after: int) -> bool:
    return now is not None and (now.newest_event > after or now.state is None or now.state in TASK_FINAL)


def key_revoked(what: str) -> ApiError:
    """401 `api_key_revoked`: the key ``what`` (a stream, a request) began with stopped authenticating since."""
    return ApiError(401, AUTHENTICATION, "api_key_revoked",
                    f"The API key this {what} was revoked, or its tenant deleted.",
                    headers={"WWW-Authenticate": "Bearer"})


KEY_REVOKED = key_revoked("stream was opened with")
REVOKED_BLOCK = f"event: error\ndata: {json.dumps(KEY_REVOKED.body())}\n\n"


async def event_stream(tenant_id: str, task_id: str, after: int, key_id: str | None) -> AsyncIterator[str]:
    """The stream of a task of `tenant_id` opened with the API key `key_id` (None: the admin token), after event id
    `after`."""
    watch = task_watch()
    last_write = time.monotonic()
    with watch.watching(task_id, key_id):
        while True:
            # Every read of events checks the key, so a stream whose events never stop coming (a full batch is
            # followed at once by the next) ends too.
            polled = await anyio.to_thread.run_sync(poll, tenant_id, task_id, after, key_id)
            if not polled.key_valid:
                yield REVOKED_BLOCK
                return
            events, state = polled.events, polled.state
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
            # Until there is something to read, or the watch saw the key stop authenticating (the read says so).
            while not _worth_reading(await watch.next_tick(task_id, KEEPALIVE_S), after) and watch.key_valid(key_id):
                if time.monotonic() - last_write >= KEEPALIVE_S:
                    yield ": keep-alive\n\n"
                    last_write = time.monotonic()
