"""An open event stream ends within 2 s of its API key being revoked or its tenant deleted, with a final `error`
block in the one error shape, also while events keep coming; the other streams go on, and the watch still reads
the database once per tick however many streams and keys are open. Through the real app served by uvicorn (in a
thread, and as `loraplane api --workers 2`), over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, event

from common.tables import Task
from tests.api.test_api_scaling import _connections_held, _server_workers, api
from tests.e2e.procs import app_in_thread
from tests.factories import ADMIN, TenantKey, add_events, make_task, make_tenant, update_row

PROMISE_S = 2.0  # a revoked key's streams end within this long of the revocation's answer
GENEROUS_S = 60.0  # how long a test waits for what it then measures (a loaded machine is slow, not wrong)


@pytest.fixture(scope="module")
def server(database: str) -> Iterator[str]:
    with app_in_thread() as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def http(server: str, clean_db: None) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=30) as c:
        yield c


@dataclass
class Stream:
    """An event stream read on a thread of its own: its status, its blocks as they arrive, and when it ended."""

    status: int = 0
    blocks: list[dict[str, str]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0

    def events(self) -> list[str]:
        return [b["event"] for b in self.blocks if "event" in b]

    def wait_for(self, what: Callable[[], bool]) -> None:
        deadline = time.monotonic() + GENEROUS_S
        while not what():
            assert time.monotonic() < deadline and not self.ended.is_set(), self.events()[-5:]
            time.sleep(0.01)


def read_in_background(method: str, url: str, headers: dict[str, str], body: Any = None) -> Stream:
    """``method url`` read as an event stream on a thread of its own (an event stream's, or a streamed completion's)."""
    stream = Stream()

    def read() -> None:
        try:
            with httpx.stream(method, url, headers=headers, json=body, timeout=httpx.Timeout(30, read=GENEROUS_S)) as r:
                stream.status = r.status_code
                block: dict[str, str] = {}
                for line in r.iter_lines():
                    if line:
                        name, _, value = line.partition(": ")
                        block[name] = value
                    elif block:
                        stream.blocks.append(block)
                        stream.started.set()
                        block = {}
        finally:
            stream.ended_at = time.monotonic()
            stream.ended.set()

    threading.Thread(target=read, name="sse-reader", daemon=True).start()
    return stream


def open_stream(base: str, headers: dict[str, str], task_id: str) -> Stream:
    """The stream, once it is live (it sent its first event: task.created)."""
    stream = read_in_background("GET", f"{base}/v1/tasks/{task_id}/events/stream", headers)
    assert stream.started.wait(GENEROUS_S), "the stream sent nothing"
    assert stream.status == 200, stream.blocks
    return stream


@contextmanager
def events_flowing(tenant: TenantKey, task_id: str, on: bool = True) -> Iterator[None]:
    """A task event every ~20 ms while inside (as a busy task's points and trials make them)."""
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            add_events(tenant.id, task_id, ["trial.metrics"])
            stop.wait(0.02)

    producer = threading.Thread(target=produce, daemon=True)
    if on:
        producer.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            producer.join(timeout=GENEROUS_S)


def assert_ended_by_revocation(stream: Stream, answered_at: float) -> float:
    """The stream ended with the `error` block, within PROMISE_S of the answer; returns how long it took."""
    assert stream.ended.wait(GENEROUS_S), "the stream is still open"
    took = stream.ended_at - answered_at
    last = stream.blocks[-1]
    assert last["event"] == "error", stream.events()[-5:]
    assert json.loads(last["data"]) == {"error": {
        "type": "authentication_error", "code": "api_key_revoked",
        "message": "The API key this stream was opened with was revoked, or its tenant deleted.", "param": None}}
    assert took < PROMISE_S, f"the stream ended {took:.2f} s after the revocation"
    return took


def revoke_key(http: httpx.Client, tenant: TenantKey) -> None:
    assert http.delete(f"/v1/admin/api-keys/{tenant.key_id}", headers=ADMIN).status_code == 200


def delete_tenant(http: httpx.Client, tenant: TenantKey) -> None:
    assert http.delete(f"/v1/admin/tenants/{tenant.id}", headers=ADMIN).status_code == 200


@pytest.mark.parametrize("flowing", [False, True], ids=["idle", "events-flowing"])
@pytest.mark.parametrize("revoke", [revoke_key, delete_tenant], ids=["key-revoked", "tenant-deleted"])
def test_a_stream_ends_within_2s_of_its_key_revoked_or_tenant_deleted(
    http: httpx.Client, server: str, revoke: Callable[[httpx.Client, TenantKey], None], flowing: bool
) -> None:
    tenant, bystander = make_tenant(http), make_tenant(http)  # type: ignore[arg-type]
    task_id, other_task_id = make_task(http, tenant)["id"], make_task(http, bystander)["id"]  # type: ignore[arg-type]
    stream = open_stream(server, tenant.headers, task_id)
    other = open_stream(server, bystander.headers, other_task_id)
    try:
        with events_flowing(tenant, task_id, on=flowing):
            if flowing:  # the stream delivers them as they come
                stream.wait_for(lambda: "trial.metrics" in stream.events())
            revoke(http, tenant)
            answered_at = time.monotonic()
            took = assert_ended_by_revocation(stream, answered_at)
        print(f"{revoke.__name__} ({'events flowing' if flowing else 'idle'}): the stream ended {took:.3f} s after")
        assert http.get(f"/v1/tasks/{task_id}", headers=tenant.headers).status_code == 401

        # Another tenant's stream is untouched: it is open and delivers what comes next.
        assert not other.ended.is_set()
        add_events(bystander.id, other_task_id, ["trial.started"])
        other.wait_for(lambda: "trial.started" in other.events())
    finally:
        update_row(Task, task_id, state="failed")  # ends any stream left open (the feature broken)
        update_row(Task, other_task_id, state="failed")
        assert stream.ended.wait(GENEROUS_S) and other.ended.wait(GENEROUS_S)
    assert other.events()[-1] == "end"


def test_revoking_one_key_ends_only_its_streams(http: httpx.Client, server: str) -> None:
    tenant = make_tenant(http)  # type: ignore[arg-type]
    r = http.post(f"/v1/admin/tenants/{tenant.id}/api-keys", json={"name": "second"}, headers=ADMIN)
    second = {"Authorization": f"Bearer {r.json()['key']}"}
    task_id = make_task(http, tenant)["id"]  # type: ignore[arg-type]
    first_streams = [open_stream(server, tenant.headers, task_id) for _ in range(3)]
    kept = open_stream(server, second, task_id)
    try:
        revoke_key(http, tenant)
        answered_at = time.monotonic()
        for stream in first_streams:
            assert_ended_by_revocation(stream, answered_at)
        assert not kept.ended.is_set()
        add_events(tenant.id, task_id, ["trial.started"])
        kept.wait_for(lambda: "trial.started" in kept.events())
    finally:
        update_row(Task, task_id, state="failed")
        assert kept.ended.wait(GENEROUS_S)
    assert kept.events()[-1] == "end"


def test_the_watch_reads_once_per_tick_however_many_streams_and_keys(http: httpx.Client, server: str) -> None:
    from api.sse import POLL_S

    tenant = make_tenant(http)  # type: ignore[arg-type]
    task_id = make_task(http, tenant)["id"]  # type: ignore[arg-type]
    keys = [http.post(f"/v1/admin/tenants/{tenant.id}/api-keys", headers=ADMIN).json()["key"] for _ in range(20)]
    streams = [open_stream(server, {"Authorization": f"Bearer {key}"}, task_id) for key in keys for _ in range(2)]
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    event.listen(Engine, "before_cursor_execute", count)  # every engine of this process (the server's included)
    try:
        window = 3.0
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < window:
            time.sleep(0.05)
    finally:
        event.remove(Engine, "before_cursor_execute", count)
        update_row(Task, task_id, state="failed")
    # 40 idle streams over 20 keys: one statement per tick (at most one more for a tick cut by the window), where
    # a statement per stream or per key would be 40 or 20 times that.
    assert 1 <= len(statements) <= elapsed / POLL_S + 1, statements
    assert all("api_keys" in s and "tasks" in s for s in statements)
    for stream in streams:
        assert stream.ended.wait(GENEROUS_S)
        assert stream.events()[-1] == "end"


def test_streams_on_every_process_of_api_workers_2_end(clean_db: None, tmp_path: Path) -> None:
    with api(tmp_path, workers=2) as (base, proc), httpx.Client(base_url=base, timeout=30) as http:
        port = int(base.rsplit(":", 1)[1])
        tenant = make_tenant(http)  # type: ignore[arg-type]
        task_id = make_task(http, tenant)["id"]  # type: ignore[arg-type]
        # 20 streams: the kernel spreads the connections over both processes' sockets (all on one would happen
        # once in half a million runs), so each process's own watch has some to end.
        streams = [open_stream(base, tenant.headers, task_id) for _ in range(20)]
        held = {pid: _connections_held(pid, port) for pid in _server_workers(proc.proc.pid)}
        assert len(held) == 2 and all(held.values()), held
        try:
            with events_flowing(tenant, task_id):
                revoke_key(http, tenant)
                answered_at = time.monotonic()
                took = max(assert_ended_by_revocation(stream, answered_at) for stream in streams)
            print(f"--workers 2, 20 streams: the last ended {took:.3f} s after the revocation")
        finally:
            update_row(Task, task_id, state="failed")
