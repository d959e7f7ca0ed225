"""Tenants, API keys and workers (admin token)."""

from __future__ import annotations

import hashlib

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from common.db import session_scope
from common.settings import get_settings
from common.tables import ApiKey, Worker, utcnow
from tests.factories import ADMIN, TenantKey, make_tenant


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "missing_admin_token"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 401, "invalid_authorization"),
        ({"Authorization": "Bearer wrong-token"}, 403, "invalid_admin_token"),
    ],
)
def test_admin_routes_refuse_missing_or_wrong_token(
    client: TestClient, headers: dict[str, str], status: int, code: str
) -> None:
    r = client.get("/v1/admin/tenants", headers=headers)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


def test_admin_routes_refuse_a_tenant_api_key(client: TestClient, tenant: TenantKey) -> None:
    r = client.post("/v1/admin/tenants", json={"name": "sneaky"}, headers=tenant.headers)
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_error"


def test_admin_routes_403_when_no_admin_token_is_configured(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(get_settings(), "admin_token", None)
    r = client.get("/v1/admin/tenants", headers=ADMIN)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "admin_disabled"
    assert "LORAPLANE_ADMIN_TOKEN" in r.json()["error"]["message"]


def test_create_tenant_fills_quota_defaults_from_settings(client: TestClient) -> None:
    r = client.post("/v1/admin/tenants", json={"name": "initech"}, headers=ADMIN)
    assert r.status_code == 201
    body = r.json()
    settings = get_settings()
    assert body["object"] == "tenant" and body["id"].startswith("tenant-")
    assert body["weight"] == 1.0
    assert body["max_concurrent_trials"] == settings.default_max_concurrent_trials
    assert body["max_trials_per_task"] == settings.default_max_trials_per_task
    assert body["max_file_bytes"] == settings.default_max_file_bytes
    assert body["created_at"].endswith("Z")


def test_create_tenant_duplicate_name_is_409(client: TestClient, tenant: TenantKey) -> None:
    r = client.post("/v1/admin/tenants", json={"name": tenant.name}, headers=ADMIN)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "tenant_exists"


@pytest.mark.parametrize(
    ("body", "param"),
    [({}, "name"), ({"name": ""}, "name"), ({"name": "x", "weight": 0}, "weight"),
     ({"name": "x", "max_file_bytes": 0}, "max_file_bytes"), ({"name": "x", "color": "red"}, "color")],
)
def test_create_tenant_rejects_bad_fields(client: TestClient, body: dict, param: str) -> None:
    r = client.post("/v1/admin/tenants", json=body, headers=ADMIN)
    assert r.status_code == 422
    assert r.json()["error"]["param"] == param


def test_get_list_and_patch_tenants(client: TestClient, tenant: TenantKey, other_tenant: TenantKey) -> None:
    listed = client.get("/v1/admin/tenants", headers=ADMIN).json()
    assert [t["name"] for t in listed["data"]] == ["globex", "acme"]  # newest first
    page = client.get("/v1/admin/tenants?limit=1", headers=ADMIN).json()
    assert page["has_more"] is True
    rest = client.get(f"/v1/admin/tenants?limit=1&after={page['data'][0]['id']}", headers=ADMIN).json()
    assert [t["name"] for t in rest["data"]] == ["acme"] and rest["has_more"] is False

    r = client.patch(f"/v1/admin/tenants/{tenant.id}", json={"weight": 2.5, "max_trials_per_task": 4}, headers=ADMIN)
    assert r.status_code == 200
    assert (r.json()["weight"], r.json()["max_trials_per_task"], r.json()["name"]) == (2.5, 4, "acme")
    assert client.get(f"/v1/admin/tenants/{tenant.id}", headers=ADMIN).json()["weight"] == 2.5

    r = client.patch(f"/v1/admin/tenants/{tenant.id}", json={"name": "globex"}, headers=ADMIN)
    assert r.status_code == 409
    assert client.get("/v1/admin/tenants/tenant-missing", headers=ADMIN).status_code == 404


def test_api_key_is_shown_once_and_only_its_hash_is_stored(client: TestClient, tenant: TenantKey) -> None:
    r = client.post(f"/v1/admin/tenants/{tenant.id}/api-keys", json={"name": "ci"}, headers=ADMIN)
    assert r.status_code == 201
    created = r.json()
    key = created["key"]
    assert key.startswith("lp_") and len(key) > 40
    assert created["object"] == "api_key" and created["name"] == "ci" and key.startswith(created["prefix"])

    with session_scope() as session:
        row = session.scalar(select(ApiKey).where(ApiKey.id == created["id"]))
        assert row is not None
        assert row.key_hash == hashlib.sha256(key.encode()).hexdigest()
        assert key not in (row.key_hash, row.prefix, row.name, row.id)

    listed = client.get(f"/v1/admin/tenants/{tenant.id}/api-keys", headers=ADMIN)
    assert key not in listed.text
    assert {k["id"] for k in listed.json()["data"]} == {tenant.key_id, created["id"]}
    assert all("key" not in k for k in listed.json()["data"])

    assert client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_revoked_key_is_refused(client: TestClient, tenant: TenantKey) -> None:
    assert client.get("/v1/files", headers=tenant.headers).status_code == 200
    r = client.delete(f"/v1/admin/api-keys/{tenant.key_id}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    r = client.get("/v1/files", headers=tenant.headers)
    assert r.status_code == 401
    assert r.json()["error"] == {
        "type": "authentication_error", "code": "invalid_api_key", "param": None,
        "message": "The API key is not valid (unknown or revoked).",
    }
    assert client.delete("/v1/admin/api-keys/key-missing", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    ("headers", "code"),
    [({}, "missing_api_key"), ({"Authorization": "Bearer lp_not-a-key"}, "invalid_api_key"),
     ({"Authorization": "Token abc"}, "invalid_authorization")],
)
def test_tenant_routes_refuse_missing_or_unknown_key(client: TestClient, headers: dict, code: str) -> None:
    r = client.get("/v1/tasks", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == code
    assert r.headers["www-authenticate"] == "Bearer"


def test_api_keys_of_a_missing_tenant_are_404(client: TestClient) -> None:
    assert client.post("/v1/admin/tenants/tenant-missing/api-keys", headers=ADMIN).status_code == 404
    assert client.get("/v1/admin/tenants/tenant-missing/api-keys", headers=ADMIN).status_code == 404


def test_list_workers(client: TestClient) -> None:
    with session_scope() as session:
        session.add(Worker(id="gpu-0", queue="lp:gpu-0", device="cuda:0", memory_bytes=80 << 30, max_slots=8,
                           state="alive", last_heartbeat=utcnow(), registered_at=utcnow()))
    r = client.get("/v1/admin/workers", headers=ADMIN)
    assert r.status_code == 200
    [worker] = r.json()["data"]
    assert (worker["id"], worker["object"], worker["device"], worker["state"]) == ("gpu-0", "worker", "cuda:0", "alive")


def test_tenants_created_by_factory_are_distinct(client: TestClient) -> None:
    a, b = make_tenant(client), make_tenant(client)
    assert a.id != b.id and a.key != b.key
