"""The status read (`GET /v1/tasks/{id}`), which checks the API key inside its own query (api/routes/tasks.py):
it refuses keys exactly as every other route does, and answers 401 before 404."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete

from common.db import session_scope
from common.tables import Trial
from tests.factories import ADMIN, TenantKey, make_task

MISSING_TASK = "task-00000000000000000000"
INVALID_KEY = {"type": "authentication_error", "code": "invalid_api_key", "param": None,
               "message": "The API key is not valid (unknown or revoked)."}


@pytest.mark.parametrize(
    ("headers", "code"),
    [({}, "missing_api_key"), ({"Authorization": "Bearer lp_not-a-key"}, "invalid_api_key"),
     ({"Authorization": "Token abc"}, "invalid_authorization")],
)
@pytest.mark.parametrize("which", ["existing", "missing"])
def test_a_bad_key_is_refused_before_the_task_is_looked_up(
    client: TestClient, tenant: TenantKey, headers: dict, code: str, which: str
) -> None:
    task_id = make_task(client, tenant)["id"] if which == "existing" else MISSING_TASK
    r = client.get(f"/v1/tasks/{task_id}", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == code
    assert r.headers["www-authenticate"] == "Bearer"


def test_a_revoked_key_reads_no_status(client: TestClient, tenant: TenantKey) -> None:
    task_id = make_task(client, tenant)["id"]
    assert client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).status_code == 200
    assert client.delete(f"/v1/admin/api-keys/{tenant.key_id}", headers=ADMIN).status_code == 200
    r = client.get(f"/v1/tasks/{task_id}", headers=tenant.headers)
    assert (r.status_code, r.json()["error"]) == (401, INVALID_KEY)


def test_a_missing_task_is_a_404_for_a_valid_key(client: TestClient, tenant: TenantKey) -> None:
    r = client.get(f"/v1/tasks/{MISSING_TASK}", headers=tenant.headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_task_without_trials_reads_as_empty(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    with session_scope() as session:
        session.execute(delete(Trial).where(Trial.task_id == task["id"]))
    body = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert body["id"] == task["id"] and set(body["trial_counts"].values()) == {0}
    assert (body["progress"], body["best_trial"]) == (0.0, None)
