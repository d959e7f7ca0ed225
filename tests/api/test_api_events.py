"""Task events: cursor pages and the Server-Sent Events stream."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from common.tables import Task
from tests.factories import TenantKey, add_events, make_task, update_row


def _sse_blocks(text: str) -> list[dict[str, str]]:
    """Parses an SSE body into blocks; a comment block is {"comment": ...}."""
    blocks = []
    for raw in text.split("\n\n"):
        if not raw.strip():
            continue
        block: dict[str, str] = {}
        for line in raw.split("\n"):
            if line.startswith(":"):
                block["comment"] = line[1:].strip()
            else:
                field, _, value = line.partition(": ")
                block[field] = value
        blocks.append(block)
    return blocks


def _stream(
    client: TestClient, tenant: TenantKey, task_id: str, headers: dict[str, str] | None = None,
    params: dict[str, int] | None = None,
) -> tuple[str, str]:
    url = f"/v1/tasks/{task_id}/events/stream"
    with client.stream("GET", url, headers={**tenant.headers, **(headers or {})}, params=params) as r:
        assert r.status_code == 200
        return r.headers["content-type"], r.read().decode()


# One trial: no `task.small_validation` warning among the events these tests count.
ONE_TRIAL = {"search_space": {"learning_rate": [1e-4]}}


def test_events_page_in_order_with_after(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, **ONE_TRIAL)
    ids = add_events(tenant.id, task["id"], ["trial.started", "trial.metrics", "trial.completed", "task.succeeded"])
    url = f"/v1/tasks/{task['id']}/events"
    page = client.get(f"{url}?limit=2", headers=tenant.headers).json()
    assert [e["type"] for e in page["data"]] == ["task.created", "trial.started"]
    assert page["has_more"] is True and page["next_after"] == ids[0]
    event = page["data"][1]
    assert set(event) == {"id", "object", "created_at", "type", "level", "message", "trial_id", "data"}
    assert (event["object"], event["level"], event["data"]) == ("event", "info", {"n": 0})

    rest = client.get(f"{url}?after={page['next_after']}&limit=10", headers=tenant.headers).json()
    assert [e["id"] for e in rest["data"]] == ids[1:]
    assert rest["has_more"] is False and rest["next_after"] == ids[-1]
    tail = client.get(f"{url}?after={ids[-1]}", headers=tenant.headers).json()
    assert tail["data"] == [] and tail["next_after"] == ids[-1]
    assert client.get(f"{url}?limit=1001", headers=tenant.headers).status_code == 422


def test_events_of_one_task_only(client: TestClient, tenant: TenantKey) -> None:
    a, b = make_task(client, tenant, **ONE_TRIAL), make_task(client, tenant)
    add_events(tenant.id, b["id"], ["trial.started"])
    data = client.get(f"/v1/tasks/{a['id']}/events", headers=tenant.headers).json()["data"]
    assert [e["type"] for e in data] == ["task.created"]


def test_stream_sends_every_event_then_end_when_the_task_is_final(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, **ONE_TRIAL)
    ids = add_events(tenant.id, task["id"], ["trial.started", "trial.completed", "task.succeeded"])
    update_row(Task, task["id"], state="succeeded")

    content_type, text = _stream(client, tenant, task["id"])
    assert content_type.startswith("text/event-stream")
    blocks = _sse_blocks(text)
    assert [b["event"] for b in blocks] == ["task.created", "trial.started", "trial.completed", "task.succeeded", "end"]
    assert [int(b["id"]) for b in blocks[1:-1]] == ids
    assert json.loads(blocks[2]["data"])["type"] == "trial.completed"
    assert json.loads(blocks[-1]["data"]) == {"task_id": task["id"], "state": "succeeded"}
    assert "id" not in blocks[-1]


def test_stream_resumes_after_last_event_id_or_after(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    ids = add_events(tenant.id, task["id"], ["a", "b", "c", "d"])
    update_row(Task, task["id"], state="failed")
    _, text = _stream(client, tenant, task["id"], headers={"Last-Event-ID": str(ids[1])})
    assert [b["event"] for b in _sse_blocks(text)] == ["c", "d", "end"]
    _, text = _stream(client, tenant, task["id"], params={"after": ids[2]})
    assert [b["event"] for b in _sse_blocks(text)] == ["d", "end"]
    r = client.get(f"/v1/tasks/{task['id']}/events/stream", headers={**tenant.headers, "Last-Event-ID": "x"})
    assert (r.status_code, r.json()["error"]["param"]) == (422, "Last-Event-ID")


def test_stream_follows_new_events_with_keepalives(
    client: TestClient, tenant: TenantKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("api.sse.POLL_S", 0.02)
    monkeypatch.setattr("api.sse.KEEPALIVE_S", 0.05)
    task = make_task(client, tenant, **ONE_TRIAL)

    def scheduler() -> None:
        time.sleep(0.3)
        add_events(tenant.id, task["id"], ["trial.started"])
        time.sleep(0.2)
        add_events(tenant.id, task["id"], ["task.failed"])
        update_row(Task, task["id"], state="failed")

    worker = threading.Thread(target=scheduler)
    worker.start()
    _, text = _stream(client, tenant, task["id"])
    worker.join()
    blocks = _sse_blocks(text)
    assert [b["event"] for b in blocks if "event" in b] == ["task.created", "trial.started", "task.failed", "end"]
    assert {"comment": "keep-alive"} in blocks
