"""DPO tasks at the API (issue 36): `objective: {"type": "dpo", ...}` on preference rows, beta a dimension of the
search space, judged by loss or reward accuracy; each mismatch of objective, rows, beta and metric a 422 in the one
error shape, nothing created."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from common.tables import Task
from tests.factories import TenantKey, count_rows, prompt_rows, task_body, upload


def preference_file(client: TestClient, tenant: TenantKey, n: int = 40) -> str:
    rows = "".join(json.dumps({"prompt": f"{i} plus 1 is", "chosen": f" {i + 1}", "rejected": f" {i + 2}"}) + "\n"
                   for i in range(n)).encode()
    body = upload(client, tenant, rows, filename="prefs.jsonl")
    assert body["format"] == "preference"
    return str(body["id"])


def _hyperparameters(client: TestClient, tenant: TenantKey, task_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/tasks/{task_id}/trials", headers=tenant.headers, params={"limit": 100})
    assert r.status_code == 200, r.text
    return [t["hyperparameters"] for t in sorted(r.json()["data"], key=lambda t: t["index"])]


def test_a_dpo_task_searches_learning_rate_by_beta(client: TestClient, tenant: TenantKey) -> None:
    prefs = preference_file(client, tenant)
    r = client.post("/v1/tasks", headers=tenant.headers, json=task_body(
        prefs, objective={"type": "dpo", "loss": "sigmoid", "label_smoothing": 0.1},
        search_space={"learning_rate": [1e-5, 1e-4], "beta": [0.05, 0.5]},
        evaluation={"metric": "reward_accuracy"}))
    assert r.status_code == 201, r.text
    task = r.json()
    assert task["objective"] == {"type": "dpo", "loss": "sigmoid", "label_smoothing": 0.1}
    assert task["search_space"]["beta"] == [0.05, 0.5] and task["evaluation"]["metric"] == "reward_accuracy"
    trials = _hyperparameters(client, tenant, task["id"])
    assert [(t["learning_rate"], t["beta"]) for t in trials] == [
        (1e-5, 0.05), (1e-5, 0.5), (1e-4, 0.05), (1e-4, 0.5)]
    # A DPO row is two sequences: the estimate counts both.
    sft = client.post("/v1/tasks", headers=tenant.headers, json=task_body(
        upload(client, tenant, prompt_rows(40))["id"], search_space={"learning_rate": [1e-5, 1e-4, 1e-3, 1e-2]}))
    assert task["estimate"]["tokens"] == 2 * sft.json()["estimate"]["tokens"], (task["estimate"], sft.json())


def test_a_dpo_tasks_defaults_one_beta_and_a_tenth_of_sfts_learning_rate(client: TestClient,
                                                                         tenant: TenantKey) -> None:
    prefs = preference_file(client, tenant)
    dpo = client.post("/v1/tasks", headers=tenant.headers, json=task_body(
        prefs, objective={"type": "dpo", "beta": 0.2}, search_space={"lora_rank": [8]})).json()
    assert dpo["search_space"]["beta"] == [0.2] and dpo["objective"]["loss"] == "sigmoid"
    fixed = client.post("/v1/tasks", headers=tenant.headers, json={  # OpenAI's names: one trial of fixed values
        "model": "tiny-random-llama", "training_file": prefs, "objective": {"type": "dpo"},
        "hyperparameters": {"beta": 0.3, "n_epochs": 1}})
    assert fixed.status_code == 201, fixed.text
    assert _hyperparameters(client, tenant, fixed.json()["id"])[0]["beta"] == 0.3
    sft = client.post("/v1/tasks", headers=tenant.headers, json=task_body(
        upload(client, tenant, prompt_rows(40))["id"], search_space={"lora_rank": [8]})).json()
    assert "beta" not in sft["search_space"] and sft["objective"] == {"type": "sft"}
    assert dpo["search_space"]["learning_rate"][0] == pytest.approx(sft["search_space"]["learning_rate"][0] / 10)
    auto = client.post("/v1/tasks", headers=tenant.headers, json=task_body(
        prefs, objective={"type": "dpo"}, search_space="auto")).json()
    trials = _hyperparameters(client, tenant, auto["id"])
    assert len(trials) == 6 and {t["beta"] for t in trials} == {0.1}
    preview = client.post("/v1/search-spaces/expand", headers=tenant.headers, json={
        "search_space": {"beta": {"min": 0.01, "max": 1, "num": 3, "scale": "log"}}, "objective": {"type": "dpo"}})
    assert [t["beta"] for t in preview.json()["trials"]] == [0.01, 0.1, 1.0], preview.text


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"search_space": {"beta": [0.1]}}, "search_space.beta", "unknown_field"),
    ({"hyperparameters": {"beta": 0.1}, "search_space": None}, "search_space.beta", "unknown_field"),
    ({"objective": {"type": "sft", "beta": 0.1}}, "objective.beta", "unknown_field"),
    ({"objective": {"type": "dpo", "beta": 0.1}, "search_space": {"beta": [0.2]}}, "objective.beta",
     "conflicting_fields"),
    ({"objective": {"type": "dpo", "beta": 0}}, "objective.beta", "invalid_value"),
    ({"objective": {"type": "dpo", "loss": "ipo", "label_smoothing": 0.1}}, "objective.label_smoothing",
     "unknown_field"),
    ({"objective": {"type": "ppo"}}, "objective.type", "invalid_value"),
    ({"evaluation": {"metric": "reward_accuracy"}}, "evaluation.metric", "metric_not_for_objective"),
    ({"objective": {"type": "dpo"}, "evaluation": {"metric": "exact_match"}}, "evaluation.metric",
     "metric_not_for_objective"),
    ({"objective": {"type": "dpo"}, "training_file": "sft"}, "training_file", "dpo_needs_preference_rows"),
    ({"objective": {"type": "dpo"}, "validation_file": "sft"}, "validation_file", "dpo_needs_preference_rows"),
])
def test_mismatched_objective_rows_beta_and_metric_are_refused(client: TestClient, tenant: TenantKey,
                                                               fields: dict[str, Any], param: str, code: str) -> None:
    prefs, sft = preference_file(client, tenant), upload(client, tenant, prompt_rows(40))["id"]
    files = {"sft": sft, "prefs": prefs}
    fields = {k: files.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}
    body = task_body(prefs if fields.get("objective", {}).get("type") == "dpo" else sft)
    if fields.get("search_space", body["search_space"]) is None:  # OpenAI's fixed hyperparameters instead
        del body["search_space"], fields["search_space"]
    before = count_rows(Task)
    r = client.post("/v1/tasks", headers=tenant.headers, json={**body, **fields})
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (422, param, code), r.text
    assert count_rows(Task) == before
