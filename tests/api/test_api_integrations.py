"""A task's experiment trackers through the API: checked like a webhook's URL at submission, the token kept
encrypted and never shown, each trial's run listed at GET .../integrations, another tenant's a 404. The sync against
a real MLflow server: tests/scheduler/test_trackers.py."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import select

from common.db import session_scope
from common.secret_box import get_secret_box
from common.tables import Tracker, TrackerRun
from tests.factories import TenantKey, make_task, make_tenant, task_body, trial_ids, upload

MLFLOW = {"type": "mlflow", "tracking_uri": "https://example.com/mlflow", "experiment": "sweeps",
          "token": "dapi-secret-token"}


def test_a_tasks_trackers_are_kept_with_their_tokens_encrypted(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, integrations=[MLFLOW, {"type": "mlflow", "tracking_uri": "http://example.com"}])
    assert task["integrations"] == [
        {"type": "mlflow", "tracking_uri": "https://example.com/mlflow", "experiment": "sweeps", "token_set": True},
        {"type": "mlflow", "tracking_uri": "http://example.com", "experiment": "loraplane", "token_set": False}]
    assert "dapi-secret-token" not in client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).text
    with session_scope() as s:
        trackers = list(s.scalars(select(Tracker).where(Tracker.task_id == task["id"]).order_by(Tracker.experiment)))
        assert trackers[1].token_encrypted and "dapi-secret-token" not in trackers[1].token_encrypted
        assert get_secret_box().decrypt(trackers[1].token_encrypted) == "dapi-secret-token"
        assert trackers[0].token_encrypted is None
        trial_id = trial_ids(task["id"])[0]
        s.add(TrackerRun(tracker_id=trackers[1].id, trial_id=trial_id, run_id="abc123", attempts=2,
                         last_error="HTTP 503"))
    listed = client.get(f"/v1/tasks/{task['id']}/integrations", headers=tenant.headers)
    assert listed.status_code == 200, listed.text
    by_experiment = {i["experiment"]: i for i in listed.json()["data"]}
    assert by_experiment["sweeps"]["runs"] == [{"trial_id": trial_id, "trial_index": 0, "run_id": "abc123",
                                                "finished": False, "attempts": 2, "last_error": "HTTP 503"}]
    assert by_experiment["loraplane"]["runs"] == [] and not by_experiment["sweeps"]["done"]
    assert "dapi-secret-token" not in listed.text
    other = make_tenant(client, "other-integrations")
    r = client.get(f"/v1/tasks/{task['id']}/integrations", headers=other.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "task_not_found")


def test_a_trackers_url_is_refused_like_a_webhooks(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]

    def refused(integration: dict[str, object]) -> tuple[int, str, str | None]:
        r = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id, integrations=[integration]))
        error = r.json()["error"]
        return r.status_code, error["code"], error.get("param")

    assert refused({**MLFLOW, "tracking_uri": "http://localhost:5000"}) == (
        422, "url_not_allowed", "integrations[0].tracking_uri")
    assert refused({**MLFLOW, "tracking_uri": "http://metadata.google.internal/"})[1] == "url_not_allowed"
    assert refused({**MLFLOW, "tracking_uri": "http://no-such-host.invalid/"})[1] == "url_unresolvable"
    assert refused({**MLFLOW, "tracking_uri": "file:///etc/passwd"})[1] == "invalid_url"
    assert refused({"type": "wandb", "project": "p"})[:2] == (422, "invalid_value")  # online needs its key
    assert refused({"type": "wandb", "project": "no spaces", "mode": "offline"})[0] == 422
    assert refused({"type": "comet", "project": "p"})[0] == 422  # not one this service speaks
    assert refused({**MLFLOW, "surprise": 1})[0] == 422
    r = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id, integrations=[MLFLOW] * 5))
    assert r.status_code == 422
    with session_scope() as s:
        assert s.scalar(select(Tracker.id)) is None  # nothing refused was kept


def test_a_wandb_tracker_is_kept_with_its_key_encrypted(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, integrations=[{"type": "wandb", "project": "sweeps", "entity": "team-a",
                                                    "api_key": "wandb-key-123"}])
    assert task["integrations"] == [{"type": "wandb", "project": "sweeps", "entity": "team-a", "mode": "online",
                                     "token_set": True}]
    listed = client.get(f"/v1/tasks/{task['id']}/integrations", headers=tenant.headers).json()["data"]
    assert [(i["type"], i["experiment"], i["entity"], i["mode"], i["tracking_uri"]) for i in listed] == [
        ("wandb", "sweeps", "team-a", "online", "https://api.wandb.ai")]
    with session_scope() as s:
        token = s.scalar(select(Tracker.token_encrypted).where(Tracker.task_id == task["id"]))
        assert token and "wandb-key-123" not in token and get_secret_box().decrypt(token) == "wandb-key-123"
