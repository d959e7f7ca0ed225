"""An operator deletes a tenant (`DELETE /v1/admin/tenants/{id}`): its keys stop working at once, its unfinished
tasks are cancelled as its own cancel would, its webhooks go with their deliveries; the record, its finished work,
its usage and its name stay. Against the real database."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.errors import ApiError
from api.schemas.tasks import TaskCreate
from api.schemas.webhooks import WebhookCreate
from api.services.tasks import create_task
from api.services.webhooks import create_webhook
from common.db import session_scope
from common.egress import Egress
from common.tables import ApiKey, Event, Task, Tenant, Trial, WebhookDelivery, WebhookEndpoint
from tests.factories import ADMIN, TenantKey, add_events, make_task, task_body, trial_ids, update_row, upload

# A public address written as an IP: a webhook URL every check of its host accepts, resolved without DNS. Nothing
# is sent to it here (no sender runs).
PUBLIC_HOOK = "https://93.184.216.34/hook"


def _count(model: type, tenant_id: str) -> int:
    with session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(model).where(model.tenant_id == tenant_id)) or 0)


def _delete(client: TestClient, tenant_id: str) -> dict:
    r = client.delete(f"/v1/admin/tenants/{tenant_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def test_deleting_a_tenant_revokes_its_keys_cancels_its_tasks_and_removes_its_webhooks(
    client: TestClient, tenant: TenantKey, other_tenant: TenantKey
) -> None:
    second_key = client.post(f"/v1/admin/tenants/{tenant.id}/api-keys", headers=ADMIN).json()["key"]
    running, queued, finished = (make_task(client, tenant) for _ in range(3))
    # `running` as the scheduler leaves it: one trial training, one completed, two waiting.
    update_row(Task, running["id"], state="running")
    run_trials = trial_ids(running["id"])
    update_row(Trial, run_trials[0], state="running")
    update_row(Trial, run_trials[1], state="completed")
    update_row(Task, finished["id"], state="succeeded")
    r = client.post("/v1/webhooks", json={"url": PUBLIC_HOOK}, headers=tenant.headers)
    assert r.status_code == 201, r.text
    add_events(tenant.id, finished["id"], ["task.succeeded"])  # a delivery still pending
    assert _count(WebhookDelivery, tenant.id) == 1
    theirs = make_task(client, other_tenant)

    deleted = _delete(client, tenant.id)
    assert (deleted["id"], deleted["object"], deleted["name"]) == (tenant.id, "tenant", tenant.name)
    assert deleted["deleted_at"].endswith("Z")

    # Every key of it is refused at once, as an unknown key is.
    for key in (tenant.key, second_key):
        r = client.get("/v1/files", headers={"Authorization": f"Bearer {key}"})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
    with session_scope() as session:
        keys = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)).all()
        assert len(keys) == 2 and all(k.revoked_at is not None for k in keys)

    # Its unfinished tasks are cancelled as a cancel does (trials that had finished keep their state); finished
    # ones are untouched.
    with session_scope() as session:
        states = {t.id: t.state for t in session.scalars(select(Task).where(Task.tenant_id == tenant.id))}
        assert states == {running["id"]: "cancelled", queued["id"]: "cancelled", finished["id"]: "succeeded"}
        trials = {t.id: (t.state, t.stop_reason) for t in session.scalars(select(Trial)
                                                                            .where(Trial.task_id == running["id"]))}
        assert trials[run_trials[1]] == ("completed", None)
        assert {trials[t] for t in (run_trials[0], *run_trials[2:])} == {("cancelled", "task cancelled")}
        said = session.scalars(select(Event.message).where(Event.task_id == running["id"],
                                                           Event.type == "task.cancelled")).all()
        assert said == ["Task cancelled: its tenant was deleted; 3 unfinished trial(s) cancelled."]

    # Its webhooks are gone with their deliveries, and the cancellations queued none.
    assert _count(WebhookEndpoint, tenant.id) == _count(WebhookDelivery, tenant.id) == 0

    # The other tenant is untouched.
    assert client.get(f"/v1/tasks/{theirs['id']}", headers=other_tenant.headers).json()["state"] == "queued"


def test_a_deleted_tenant_reads_as_missing_but_is_listed_on_request_and_keeps_its_usage_and_name(
    client: TestClient, tenant: TenantKey, other_tenant: TenantKey, tiny_model_dir: Path
) -> None:
    upload(client, tenant)
    _delete(client, tenant.id)
    for method, path in (("GET", ""), ("PATCH", ""), ("DELETE", ""), ("GET", "/api-keys"), ("POST", "/api-keys")):
        r = client.request(method, f"/v1/admin/tenants/{tenant.id}{path}", headers=ADMIN,
                           json={} if method != "GET" else None)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "tenant_not_found"), (method, path)

    listed = client.get("/v1/admin/tenants", headers=ADMIN).json()["data"]
    assert [t["id"] for t in listed] == [other_tenant.id]
    everyone = {t["id"]: t for t in client.get("/v1/admin/tenants?include_deleted=true", headers=ADMIN).json()["data"]}
    assert set(everyone) == {tenant.id, other_tenant.id}
    assert everyone[tenant.id]["deleted_at"].endswith("Z") and everyone[other_tenant.id]["deleted_at"] is None

    # Usage stays for billing: its stored file still counts.
    usage = {u["tenant_id"]: u for u in client.get("/v1/admin/usage", headers=ADMIN).json()["data"]}
    assert usage[tenant.id]["storage_bytes"] > 0

    # Its name stays taken (names are unique): a new tenant or a rename cannot have it.
    for r in (client.post("/v1/admin/tenants", json={"name": tenant.name}, headers=ADMIN),
              client.patch(f"/v1/admin/tenants/{other_tenant.id}", json={"name": tenant.name}, headers=ADMIN)):
        assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (409, "tenant_exists", "name")
        assert r.json()["error"]["message"] == f"A deleted tenant is named '{tenant.name}'; names are not reused."

    # Nor can a model be restricted to it.
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "m", "path": str(tiny_model_dir), "tenants": [tenant.id]})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "unknown_tenant")


def test_deleting_a_missing_tenant_is_404(client: TestClient, tenant: TenantKey) -> None:
    r = client.delete("/v1/admin/tenants/tenant-missing", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "tenant_not_found")
    assert client.delete(f"/v1/admin/tenants/{tenant.id}", headers=tenant.headers).status_code == 403


def test_a_submission_that_authenticated_before_the_deletion_writes_nothing_after_it(
    client: TestClient, tenant: TenantKey
) -> None:
    """A request that passed the key check just before the deletion committed reaches the tenant's row lock after
    it: it finds the tenant deleted and answers as its revoked key now would."""
    body = TaskCreate.model_validate(task_body(upload(client, tenant)["id"]))
    with session_scope() as session:
        authenticated = session.get_one(Tenant, tenant.id)  # what the request holds
        session.expunge(authenticated)
    _delete(client, tenant.id)
    with session_scope() as session, pytest.raises(ApiError) as refused:
        create_task(session, tenant=authenticated, body=body)
    assert (refused.value.status_code, refused.value.code) == (401, "invalid_api_key")
    assert _count(Task, tenant.id) == 0


def test_a_webhook_registered_by_a_request_that_authenticated_before_the_deletion_is_refused(
    client: TestClient, tenant: TenantKey
) -> None:
    """The same race for a webhook: its registration takes the tenant's row lock after the deletion committed, and
    leaves no endpoint (with its secret) behind for a tenant whose webhooks the deletion removed."""
    with session_scope() as session:
        authenticated = session.get_one(Tenant, tenant.id)
        session.expunge(authenticated)
    _delete(client, tenant.id)
    with session_scope() as session, pytest.raises(ApiError) as refused:
        create_webhook(session, tenant=authenticated, body=WebhookCreate(url=PUBLIC_HOOK), egress=Egress())
    assert (refused.value.status_code, refused.value.code) == (401, "invalid_api_key")
    assert _count(WebhookEndpoint, tenant.id) == 0
