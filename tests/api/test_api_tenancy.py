"""Tenant isolation: another tenant's object is answered exactly like a missing one, on every route."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from common.db import session_scope
from common.tables import MetricPoint
from tests.factories import TenantKey, add_events, make_task, store_adapter, trial_ids, upload

MISSING = {"file": "file-00000000000000000000", "task": "task-00000000000000000000",
           "trial": "trial-00000000000000000000"}

ROUTES = [
    ("GET", "/v1/files/{file}"),
    ("DELETE", "/v1/files/{file}"),
    ("GET", "/v1/tasks/{task}"),
    ("POST", "/v1/tasks/{task}/cancel"),
    ("GET", "/v1/tasks/{task}/adapter"),
    ("GET", "/v1/tasks/{task}/trials"),
    ("GET", "/v1/tasks/{task}/trials/{trial}"),
    ("GET", "/v1/tasks/{task}/trials/{trial}/metrics"),
    ("GET", "/v1/tasks/{task}/trials/{trial}/adapter"),
    ("GET", "/v1/tasks/{task}/events"),
    ("GET", "/v1/tasks/{task}/events/stream"),
    ("GET", "/v1/tasks/{task}/curves"),
    # The caller's own task with the other tenant's trial:
    ("GET", "/v1/tasks/{own_task}/trials/{trial}"),
    ("GET", "/v1/tasks/{own_task}/trials/{trial}/metrics"),
    ("GET", "/v1/tasks/{own_task}/trials/{trial}/adapter"),
]


@dataclass
class World:
    owner: TenantKey
    intruder: TenantKey
    ids: dict[str, str]


@pytest.fixture
def world(client: TestClient, tenant: TenantKey, other_tenant: TenantKey) -> World:
    file = upload(client, tenant)
    task = make_task(client, tenant, file["id"])
    trial = trial_ids(task["id"])[0]
    store_adapter(task["id"], trial)
    add_events(tenant.id, task["id"], ["trial.started"])
    with session_scope() as session:
        session.add(MetricPoint(trial_id=trial, step=1, split="train", loss=2.0))
    own_task = make_task(client, other_tenant)
    return World(owner=tenant, intruder=other_tenant,
                 ids={"file": file["id"], "task": task["id"], "trial": trial, "own_task": own_task["id"]})


def _scrub(body: dict, ids: dict[str, str]) -> dict:
    text = body["error"]["message"]
    for value in ids.values():
        text = text.replace(value, "<id>")
    return {**body["error"], "message": text}


@pytest.mark.parametrize(("method", "template"), ROUTES, ids=[f"{m} {t}" for m, t in ROUTES])
def test_other_tenants_object_is_answered_like_a_missing_one(
    client: TestClient, world: World, method: str, template: str
) -> None:
    foreign_url = template.format(**world.ids)
    missing_url = template.format(**{**world.ids, **MISSING})  # own_task stays the caller's own
    foreign = client.request(method, foreign_url, headers=world.intruder.headers)
    missing = client.request(method, missing_url, headers=world.intruder.headers)
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json()["error"]["type"] == "not_found_error"
    assert _scrub(foreign.json(), world.ids) == _scrub(missing.json(), MISSING)

    # The owner still sees everything unchanged (nothing was deleted or cancelled by the intruder).
    assert client.get(f"/v1/files/{world.ids['file']}", headers=world.owner.headers).status_code == 200
    assert client.get(f"/v1/tasks/{world.ids['task']}", headers=world.owner.headers).json()["state"] == "queued"
    if "{own_task}" not in template and method == "GET" and not template.endswith("stream"):
        assert client.get(foreign_url, headers=world.owner.headers).status_code == 200


def test_lists_never_show_another_tenants_objects(client: TestClient, world: World) -> None:
    intruder = world.intruder.headers
    assert world.ids["file"] not in client.get("/v1/files", headers=intruder).text
    tasks = client.get("/v1/tasks", headers=intruder).json()["data"]
    assert [t["id"] for t in tasks] == [world.ids["own_task"]]
    owner_tasks = client.get("/v1/tasks", headers=world.owner.headers).json()["data"]
    assert [t["id"] for t in owner_tasks] == [world.ids["task"]]
    # A cursor from another tenant is as unknown as a made-up one.
    r = client.get(f"/v1/tasks?after={world.ids['task']}", headers=intruder)
    assert (r.status_code, r.json()["error"]["param"]) == (422, "after")
