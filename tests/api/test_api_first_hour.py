"""The small things a newcomer met in the first hour (issue 32): "auto" in the search-space preview, finding a file
by its content, OpenAI's and Together's names on POST /v1/tasks, and why a failed task has no adapter."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.client import sim
from tests.factories import TenantKey, chat_rows, task_body, upload


def test_the_preview_expands_auto_as_a_task_does(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant, chat_rows(40))["id"]
    preview = client.post("/v1/search-spaces/expand", headers=tenant.headers, json={
        "search_space": "auto", "base_model": "tiny-random-llama", "training_file": file_id})
    assert preview.status_code == 200, preview.text
    r = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id, search_space="auto"))
    assert r.status_code == 201, r.text
    trials = client.get(f"/v1/tasks/{r.json()['id']}/trials", headers=tenant.headers).json()["data"]
    assert preview.json()["count"] == len(trials) == 6
    assert preview.json()["trials"] == [t["hyperparameters"] for t in trials]
    assert preview.json()["estimate"] is not None


@pytest.mark.parametrize("body", [{"search_space": "auto"},
                                  {"search_space": "auto", "base_model": "tiny-random-llama"}])
def test_the_preview_of_auto_needs_the_model_and_the_file(client: TestClient, tenant: TenantKey,
                                                          body: dict[str, Any]) -> None:
    r = client.post("/v1/search-spaces/expand", headers=tenant.headers, json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("search_space", "auto_needs_model")
    assert "base_model and training_file" in error["message"]


def test_files_are_found_by_their_content(client: TestClient, tenant: TenantKey, other_tenant: TenantKey) -> None:
    data = chat_rows(12)
    digest = hashlib.sha256(data).hexdigest()
    mine = upload(client, tenant, data, filename="a.jsonl")
    upload(client, tenant, chat_rows(13), filename="b.jsonl")
    upload(client, other_tenant, data)  # the same bytes, another tenant's: not found by this tenant
    assert mine["sha256"] == digest
    r = client.get("/v1/files", params={"sha256": digest}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert [f["id"] for f in r.json()["data"]] == [mine["id"]]
    assert len(client.get("/v1/files", headers=tenant.headers).json()["data"]) == 2
    assert client.delete(f"/v1/files/{mine['id']}", headers=tenant.headers).status_code == 200
    assert client.get("/v1/files", params={"sha256": digest}, headers=tenant.headers).json()["data"] == []
    bad = client.get("/v1/files", params={"sha256": "abc"}, headers=tenant.headers)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "sha256", bad.text


def test_openai_names_are_taken_on_a_task(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    body = {"model": "tiny-random-llama", "training_file": file_id, "suffix": "capitals-v1",
            "metadata": {"team": "geo", "ticket": "GEO-12"},
            "hyperparameters": {"learning_rate": 2e-4, "lora_rank": 8, "batch_size": "auto", "n_epochs": 3}}
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert r.status_code == 201, r.text
    task = r.json()
    assert task["base_model"] == "tiny-random-llama" and task["epochs"] == 3
    assert task["suffix"] == "capitals-v1" and task["metadata"] == {"team": "geo", "ticket": "GEO-12"}
    trials = client.get(f"/v1/tasks/{task['id']}/trials", headers=tenant.headers).json()["data"]
    assert len(trials) == 1
    assert (trials[0]["hyperparameters"]["learning_rate"], trials[0]["hyperparameters"]["lora_rank"]) == (2e-4, 8)
    assert trials[0]["hyperparameters"]["batch_size"] == task_default_batch(client, tenant)
    again = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert (again["suffix"], again["metadata"]) == ("capitals-v1", {"team": "geo", "ticket": "GEO-12"})
    plain = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id)).json()
    assert plain["suffix"] is None and plain["metadata"] is None


def task_default_batch(client: TestClient, tenant: TenantKey) -> Any:
    r = client.post("/v1/search-spaces/expand", headers=tenant.headers, json={"search_space": {}})
    return r.json()["trials"][0]["batch_size"]


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"model": "tiny-random-llama"}, "model", "not both"),  # beside base_model
    ({"hyperparameters": {"learning_rate": 1e-4}}, "hyperparameters", "not both"),  # beside search_space
    ({"hyperparameters": {"learning_rate_multiplier": 2}, "search_space": None},
     "hyperparameters.learning_rate_multiplier", "give learning_rate"),
    ({"hyperparameters": {"n_epochs": 2}, "search_space": None}, "hyperparameters.n_epochs", "not both"),  # epochs
    ({"hyperparameters": {"warmup": 2}, "search_space": None}, "hyperparameters.warmup", "lora_rank"),
    ({"hyperparameters": [1e-4], "search_space": None}, "hyperparameters", "object of fixed values"),
    ({"hyperparameters": {"learning_rate": 5.0}, "search_space": None}, "search_space.learning_rate[0]", ""),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", ""),
    ({"suffix": "x" * 65}, "suffix", ""),
])
def test_openai_names_that_do_not_map_are_refused_naming_the_field(
        client: TestClient, tenant: TenantKey, extra: dict[str, Any], param: str, fragment: str) -> None:
    body = {**task_body(upload(client, tenant)["id"]), **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert fragment in error["message"], error


def test_a_failed_task_says_why_it_has_no_adapter(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    running = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id)).json()
    early = client.get(f"/v1/tasks/{running['id']}/adapter", headers=tenant.headers)
    assert early.status_code == 409 and early.json()["error"]["code"] == "adapter_not_ready", early.text

    failed = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id)).json()
    sim.finish(failed["id"], [None] * 4, ["failed"] * 4)
    task = client.get(f"/v1/tasks/{failed['id']}", headers=tenant.headers).json()
    assert task["state"] == "failed" and task["error"]
    r = client.get(f"/v1/tasks/{failed['id']}/adapter", headers=tenant.headers)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "no_best_trial"
    assert "failed" in error["message"] and task["error"] in error["message"] and "yet" not in error["message"]
