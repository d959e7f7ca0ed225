"""`/v1/fine_tuning/jobs` at the API (issue 38; the official client's journey: tests/e2e/test_openai_sdk.py): a job
request becomes the task it describes (OpenAI's hyperparameters, ours as extensions, a list a search), a task reads
as OpenAI's job, and what cannot be mapped is a 422 in the one error shape, nothing created."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from common.registry import DEFAULT_MODELS
from common.search_space import DPO_LR_SCALE, default_learning_rate
from common.tables import Task
from tests.api.test_api_tasks_dpo import preference_file
from tests.factories import TenantKey, count_rows, prompt_rows, upload

# What the multiplier multiplies for the tiny model: a task's default rate for its size.
TINY_LR = default_learning_rate(next(d.parameters for d in DEFAULT_MODELS if d.name == "tiny-random-llama"))


def _create(client: TestClient, tenant: TenantKey, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/fine_tuning/jobs", headers=tenant.headers, json={"model": "tiny-random-llama", **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_job_is_its_task_in_openais_shape(client: TestClient, tenant: TenantKey) -> None:
    training = upload(client, tenant, prompt_rows(40))["id"]
    job = _create(client, tenant, training_file=training, suffix="v1", seed=9, metadata={"k": "v"},
                  hyperparameters={"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 2,
                                   "lora_rank": [4, 16]})
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("task-") and job["status"] == "queued"
    assert (job["model"], job["training_file"], job["seed"], job["user_provided_suffix"]) == (
        "tiny-random-llama", training, 9, "v1")
    assert job["hyperparameters"] == {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 2.0}
    assert job["method"] == {"type": "supervised", "supervised": {"hyperparameters": job["hyperparameters"]}}
    assert job["fine_tuned_model"] is None and job["error"] is None and isinstance(job["created_at"], int)
    task = client.get(f"/v1/tasks/{job['id']}", headers=tenant.headers).json()
    assert task["epochs"] == 3 and task["suffix"] == "v1" and task["metadata"] == {"k": "v"}
    assert task["search_space"]["learning_rate"] == [pytest.approx(2 * TINY_LR)]
    assert task["search_space"]["lora_rank"] == [4, 16] and job["loraplane"]["trial_counts"]["pending"] == 2
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=tenant.headers).json()["id"] == job["id"]


def test_a_dpo_job_searches_beta_and_its_rate_is_dpos(client: TestClient, tenant: TenantKey) -> None:
    job = _create(client, tenant, training_file=preference_file(client, tenant), method={
        "type": "dpo", "dpo": {"hyperparameters": {"beta": [0.1, 0.5], "learning_rate_multiplier": 1}}})
    assert job["method"]["type"] == "dpo" and job["method"]["dpo"]["hyperparameters"]["beta"] == [0.1, 0.5]
    task = client.get(f"/v1/tasks/{job['id']}", headers=tenant.headers).json()
    assert task["objective"]["type"] == "dpo"
    assert task["search_space"]["learning_rate"] == [pytest.approx(TINY_LR * DPO_LR_SCALE)]


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"hyperparameters": {"learning_rate_multiplier": 2, "learning_rate": 1e-4}}, "hyperparameters.learning_rate",
     "conflicting_fields"),
    ({"hyperparameters": {"n_epochs": 1}, "method": {"type": "supervised", "supervised": {
        "hyperparameters": {"n_epochs": 2}}}}, "hyperparameters", "conflicting_fields"),
    ({"hyperparameters": {"beta": 0.1}}, "hyperparameters.beta", "unknown_field"),
    ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "invalid_value"),
    ({"hyperparameters": {"n_epochs": [1, 2]}}, "hyperparameters.n_epochs", "invalid_value"),
    ({"hyperparameters": {"batch_size": []}}, "hyperparameters.batch_size", "invalid_value"),
    ({"hyperparameters": {"learning_rate_multiplier": -1}}, "hyperparameters.learning_rate_multiplier",
     "invalid_value"),
    ({"method": {"type": "reinforcement"}}, "method.type", "invalid_value"),
    ({"model": "gpt-4o-mini"}, "base_model", "unknown_model"),
    ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}], "suffix": "x" * 65}, "suffix",
     "invalid_value"),
])
def test_what_cannot_be_mapped_is_refused(client: TestClient, tenant: TenantKey, body: dict[str, Any], param: str,
                                          code: str) -> None:
    training = upload(client, tenant, prompt_rows(40))["id"]
    before = count_rows(Task)
    r = client.post("/v1/fine_tuning/jobs", headers=tenant.headers,
                    json={"model": "tiny-random-llama", "training_file": training, **body})
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (422, param, code), r.text
    assert count_rows(Task) == before


def test_a_wandb_integration_is_the_tasks_tracker(client: TestClient, tenant: TenantKey) -> None:
    """OpenAI's shape, with the key ours needs online (OpenAI keeps it in the organisation's settings): without it, a
    422 saying so; offline needs none."""
    training = upload(client, tenant, prompt_rows(40))["id"]
    r = client.post("/v1/fine_tuning/jobs", headers=tenant.headers, json={
        "model": "tiny-random-llama", "training_file": training,
        "integrations": [{"type": "wandb", "wandb": {"project": "p", "entity": "e", "tags": ["x"]}}]})
    assert r.status_code == 422 and "api_key" in r.json()["error"]["message"], r.text
    job = _create(client, tenant, training_file=training,
                  integrations=[{"type": "wandb", "wandb": {"project": "p", "mode": "offline"}}])
    assert job["integrations"] == [{"type": "wandb", "wandb": {"project": "p", "entity": None, "mode": "offline",
                                                               "token_set": False}}]


def test_events_page_newest_first_and_a_bad_cursor_is_a_422(client: TestClient, tenant: TenantKey) -> None:
    job = _create(client, tenant, training_file=upload(client, tenant, prompt_rows(40))["id"])
    client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=tenant.headers)
    first = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=tenant.headers, params={"limit": 1}).json()
    assert first["has_more"] and first["data"][0]["object"] == "fine_tuning.job.event"
    assert first["data"][0]["data"]["type"] == "task.cancelled"  # the newest
    rest = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=tenant.headers,
                      params={"after": first["data"][0]["id"]}).json()
    assert [e["data"]["type"] for e in rest["data"]][-1] == "task.created" and not rest["has_more"]
    bad = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=tenant.headers, params={"after": "x"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (422, "invalid_cursor")
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints", headers=tenant.headers).json()["data"] == []
