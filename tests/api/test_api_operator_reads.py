"""The operator (admin token) reads any tenant's task, trials, curves and events, each read written to the audit log
(`GET /v1/admin/audit`); the admin token cannot act as a tenant (403 `admin_read_only`); tenants stay isolated."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from common.db import session_scope
from common.settings import get_settings
from common.tables import AuditEntry, MetricPoint, Task
from tests.factories import (
    ADMIN,
    ADMIN_TOKEN,
    TenantKey,
    add_events,
    count_rows,
    make_task,
    store_adapter,
    trial_ids,
    update_row,
    upload,
)

ACTOR = "admin:" + hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()[:12]


@dataclass
class World:
    owner: TenantKey
    other: TenantKey
    task: str
    trial: str
    other_task: str


@pytest.fixture
def world(client: TestClient, tenant: TenantKey, other_tenant: TenantKey) -> World:
    task = make_task(client, tenant)
    trial = trial_ids(task["id"])[0]
    store_adapter(task["id"], trial, payload=b"\x1f\x8b the adapter")
    add_events(tenant.id, task["id"], ["trial.started"])
    with session_scope() as session:
        session.add(MetricPoint(trial_id=trial, step=1, split="train", loss=2.5))
    other_task = make_task(client, other_tenant)
    return World(owner=tenant, other=other_tenant, task=task["id"], trial=trial, other_task=other_task["id"])


def _audit(client: TestClient, **params: str) -> list[dict]:
    r = client.get("/v1/admin/audit", headers=ADMIN, params={"limit": 100, **params})
    assert r.status_code == 200, r.text
    return r.json()["data"]


# (the route's template, the path's last id: the audit row's resource_id)
READS = [
    ("/v1/tasks/{task_id}", "task"),
    ("/v1/tasks/{task_id}/trials", "task"),
    ("/v1/tasks/{task_id}/trials/{trial_id}", "trial"),
    ("/v1/tasks/{task_id}/trials/{trial_id}/metrics", "trial"),
    ("/v1/tasks/{task_id}/trials/{trial_id}/adapter", "trial"),
    ("/v1/tasks/{task_id}/adapter", "task"),
    ("/v1/tasks/{task_id}/curves", "task"),
    ("/v1/tasks/{task_id}/events", "task"),
]


@pytest.mark.parametrize(("template", "resource"), READS, ids=[t for t, _ in READS])
def test_operator_reads_a_tenants_task_route_as_the_tenant_does_and_it_is_audited(
    client: TestClient, world: World, template: str, resource: str
) -> None:
    url = template.format(task_id=world.task, trial_id=world.trial)
    as_operator = client.get(url, headers=ADMIN)
    as_owner = client.get(url, headers=world.owner.headers)
    assert as_operator.status_code == as_owner.status_code == 200, as_operator.text
    assert as_operator.content == as_owner.content  # the same answer, byte for byte

    [entry] = _audit(client)  # the owner's read wrote nothing
    resource_id = world.task if resource == "task" else world.trial
    assert {k: entry[k] for k in ("object", "actor", "method", "route", "tenant_id", "resource_id")} == {
        "object": "audit_entry", "actor": ACTOR, "method": "GET", "route": template, "tenant_id": world.owner.id,
        "resource_id": resource_id}


def test_operator_reads_show_what_the_tenant_sees(client: TestClient, world: World) -> None:
    task = client.get(f"/v1/tasks/{world.task}", headers=ADMIN).json()
    assert (task["id"], task["tenant_id"], task["state"]) == (world.task, world.owner.id, "queued")
    trials = client.get(f"/v1/tasks/{world.task}/trials", headers=ADMIN).json()["data"]
    assert [t["id"] for t in trials] == trial_ids(world.task)
    metrics = client.get(f"/v1/tasks/{world.task}/trials/{world.trial}/metrics", headers=ADMIN).json()
    assert metrics["train"] == [{"step": 1, "loss": 2.5}]
    events = client.get(f"/v1/tasks/{world.task}/events", headers=ADMIN).json()["data"]
    assert [e["type"] for e in events] == ["task.created", "task.small_validation", "trial.started"]
    adapter = client.get(f"/v1/tasks/{world.task}/adapter", headers=ADMIN)
    assert adapter.content == b"\x1f\x8b the adapter"
    curves = [json.loads(line) for line in client.get(f"/v1/tasks/{world.task}/curves", headers=ADMIN).text.split("\n")
              if line]
    assert {c["trial_id"] for c in curves} == set(trial_ids(world.task))
    assert len(_audit(client)) == 6


def test_operator_lists_every_tenants_tasks_or_one_tenants(client: TestClient, world: World) -> None:
    every = client.get("/v1/tasks", headers=ADMIN).json()["data"]
    assert {(t["id"], t["tenant_id"]) for t in every} == {(world.task, world.owner.id),
                                                          (world.other_task, world.other.id)}
    one = client.get("/v1/tasks", headers=ADMIN, params={"tenant_id": world.other.id}).json()["data"]
    assert [t["id"] for t in one] == [world.other_task]
    # Paged across tenants: the cursor may be any tenant's task.
    first = client.get("/v1/tasks", headers=ADMIN, params={"limit": 1}).json()
    second = client.get("/v1/tasks", headers=ADMIN, params={"limit": 1, "after": first["data"][0]["id"]}).json()
    assert first["has_more"] and not second["has_more"]
    assert {first["data"][0]["id"], second["data"][0]["id"]} == {world.task, world.other_task}

    entries = _audit(client)  # newest first
    assert [(e["route"], e["tenant_id"], e["resource_id"]) for e in entries] == [
        ("/v1/tasks", None, None), ("/v1/tasks", None, None), ("/v1/tasks", world.other.id, None),
        ("/v1/tasks", None, None)]
    missing = client.get("/v1/tasks", headers=ADMIN, params={"tenant_id": "tenant-00000000000000000000"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "tenant_not_found")


def test_a_tenant_lists_only_its_own_tasks_whatever_tenant_id_it_names(client: TestClient, world: World) -> None:
    own = client.get("/v1/tasks", headers=world.owner.headers, params={"tenant_id": world.owner.id})
    assert [t["id"] for t in own.json()["data"]] == [world.task]
    r = client.get("/v1/tasks", headers=world.owner.headers, params={"tenant_id": world.other.id})
    assert r.status_code == 403
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("admin_only", "tenant_id")
    assert _audit(client) == []


def test_a_tenant_still_cannot_read_another_tenants_task(client: TestClient, world: World) -> None:
    for template, _ in READS:
        url = template.format(task_id=world.task, trial_id=world.trial)
        r = client.get(url, headers=world.other.headers)
        assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found_error"), url
    r = client.get(f"/v1/tasks/{world.task}/events/stream", headers=world.other.headers)
    assert r.status_code == 404
    assert _audit(client) == []


def test_operator_reads_of_a_missing_task_are_404_and_not_audited(client: TestClient, world: World) -> None:
    for template, _ in READS:
        url = template.format(task_id="task-00000000000000000000", trial_id=world.trial)
        r = client.get(url, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "task_not_found"), url
    r = client.get(f"/v1/tasks/{world.task}/trials/trial-00000000000000000000", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "trial_not_found")
    assert _audit(client) == []


WRITES = [
    ("POST", "/v1/tasks/{task_id}/cancel"),
    ("POST", "/v1/tasks"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/usage"),
    ("GET", "/v1/webhooks"),
]


@pytest.mark.parametrize(("method", "template"), WRITES, ids=[f"{m} {t}" for m, t in WRITES])
def test_the_admin_token_cannot_act_as_a_tenant(client: TestClient, world: World, method: str, template: str) -> None:
    r = client.request(method, template.format(task_id=world.task), headers=ADMIN)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("permission_error", "admin_read_only")
    assert "tenant's API keys" in error["message"]
    assert client.get(f"/v1/tasks/{world.task}", headers=world.owner.headers).json()["state"] == "queued"


def test_a_wrong_token_is_still_a_401(client: TestClient, world: World) -> None:
    for url in (f"/v1/tasks/{world.task}", f"/v1/tasks/{world.task}/trials", f"/v1/tasks/{world.task}/cancel"):
        r = client.request("POST" if url.endswith("cancel") else "GET", url,
                           headers={"Authorization": "Bearer test-admin-tokem"})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key"), url


def test_no_admin_token_configured_reads_nothing(
    client: TestClient, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(get_settings(), "admin_token", None)
    r = client.get(f"/v1/tasks/{world.task}", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")


def _stream(client: TestClient, task_id: str) -> str:
    with client.stream("GET", f"/v1/tasks/{task_id}/events/stream", headers=ADMIN) as r:
        assert r.status_code == 200
        return r.read().decode()


def test_operator_streams_a_tenants_events_with_one_audit_row_per_stream(
    client: TestClient, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("api.sse.BATCH", 1)  # one event per read: the stream reads the database many times
    add_events(world.owner.id, world.task, ["trial.completed", "task.succeeded"])
    update_row(Task, world.task, state="succeeded")

    text = _stream(client, world.task)
    events = [line.removeprefix("event: ") for line in text.split("\n") if line.startswith("event: ")]
    assert events == ["task.created", "task.small_validation", "trial.started", "trial.completed", "task.succeeded",
                      "end"]
    [entry] = _audit(client)
    assert (entry["route"], entry["tenant_id"], entry["resource_id"]) == (
        "/v1/tasks/{task_id}/events/stream", world.owner.id, world.task)
    _stream(client, world.task)
    assert count_rows(AuditEntry) == 2


def test_audit_log_pages_newest_first_and_filters_by_tenant(client: TestClient, world: World) -> None:
    for _ in range(3):
        assert client.get(f"/v1/tasks/{world.task}", headers=ADMIN).status_code == 200
    assert client.get(f"/v1/tasks/{world.other_task}/events", headers=ADMIN).status_code == 200
    everything = _audit(client)
    assert [e["tenant_id"] for e in everything] == [world.other.id] + [world.owner.id] * 3
    assert [e["created_at"] for e in everything] == sorted((e["created_at"] for e in everything), reverse=True)

    pages: list[str] = []
    after: str | None = None
    while True:
        params: dict[str, str | int] = {"limit": 3} if after is None else {"limit": 3, "after": after}
        page = client.get("/v1/admin/audit", headers=ADMIN, params=params).json()
        pages.extend(e["id"] for e in page["data"])
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert pages == [e["id"] for e in everything]
    assert [e["id"] for e in _audit(client, tenant_id=world.owner.id)] == [e["id"] for e in everything[1:]]

    bad = client.get("/v1/admin/audit", headers=ADMIN, params={"after": "audit-nope"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (422, "invalid_cursor")
    refused = client.get("/v1/admin/audit", headers=world.owner.headers)
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "invalid_admin_token")
    assert count_rows(AuditEntry) == 4  # reading the log is not itself logged


def test_upload_by_the_tenant_then_operator_download_of_nothing_is_409_and_not_audited(
    client: TestClient, tenant: TenantKey
) -> None:
    task = make_task(client, tenant, upload(client, tenant)["id"])
    r = client.get(f"/v1/tasks/{task['id']}/adapter", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready")
    assert _audit(client) == []
