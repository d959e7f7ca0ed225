"""POST /v1/search-spaces/expand: the count a form shows before submitting is the count the task gets."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.factories import TenantKey, make_tenant, task_body, upload

SPACES: list[dict[str, Any]] = [
    {"search_space": {}},  # every default: one trial
    {"search_space": {"learning_rate": [1e-3, 3e-3], "lora_rank": [4, 8]}},
    {"search_space": {"learning_rate": [1e-3, 1e-3, 2e-3]}},  # duplicates dropped
    {"search_space": {"lora_rank": {"min": 4, "max": 5, "num": 4}}},  # int range rounds to duplicates: 4, 5
    {"search_space": {"learning_rate": {"min": 1e-4, "max": 1e-2, "num": 3, "scale": "log"},
                      "target_modules": [["q_proj", "v_proj"], "all-linear"], "batch_size": [2, 4]}},
    {"search_space": {"lora_rank": [2, 4]}, "strategy": "random", "max_trials": 10, "seed": 3},  # only 2 exist
    {"search_space": {"learning_rate": {"min": 1e-4, "max": 1e-2}}, "strategy": "random", "max_trials": 5,
     "seed": 11},
]


@pytest.mark.parametrize("space", SPACES)
def test_the_preview_matches_the_trials_a_task_gets(client: TestClient, tenant: TenantKey,
                                                    space: dict[str, Any]) -> None:
    # The model named as the task names it: a learning rate left out is set by the model's size.
    r = client.post("/v1/search-spaces/expand", json=space | {"base_model": "tiny-random-llama"},
                    headers=tenant.headers)
    assert r.status_code == 200, r.text
    preview = r.json()
    assert preview["object"] == "search_space.expansion" and preview["has_more"] is False

    file_id = upload(client, tenant)["id"]
    r = client.post("/v1/tasks", json=task_body(file_id, **space), headers=tenant.headers)
    assert r.status_code == 201, r.text
    task_id = r.json()["id"]
    trials = client.get(f"/v1/tasks/{task_id}/trials", headers=tenant.headers).json()["data"]
    assert preview["count"] == len(trials) == sum(r.json()["trial_counts"].values())
    assert preview["trials"] == [t["hyperparameters"] for t in trials]


def test_a_learning_rate_left_out_is_set_by_the_models_size(client: TestClient, tenant: TenantKey) -> None:
    def preview(**extra: Any) -> float:
        r = client.post("/v1/search-spaces/expand", json={"search_space": {"lora_rank": [8]}, **extra},
                        headers=tenant.headers)
        assert r.status_code == 200, r.text
        [trial] = r.json()["trials"]
        return float(trial["learning_rate"])

    assert preview(base_model="tiny-random-llama") == 1e-3  # a model below 1B parameters
    assert preview() == 2e-4  # no model named: its size is unknown


def test_the_preview_lists_at_most_limit_trials(client: TestClient, tenant: TenantKey) -> None:
    body = {"search_space": {"learning_rate": [1e-3, 2e-3, 3e-3], "lora_rank": [4, 8]}}
    r = client.post("/v1/search-spaces/expand?limit=2", json=body, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert (r.json()["count"], len(r.json()["trials"]), r.json()["has_more"]) == (6, 2, True)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"search_space": {"learning_rate": [2.0]}}, "search_space.learning_rate[0]", "invalid_value"),
        ({"search_space": {"lora_rank": {"min": 8, "max": 4, "num": 2}}}, "search_space.lora_rank", None),
        ({"search_space": {"lora_rank": {"min": 4, "max": 8}}}, "search_space.lora_rank.num", "invalid_value"),
        ({"search_space": {}, "strategy": "random"}, "max_trials", "missing_field"),
        ({"search_space": {"lora_rank": [2, 4, 8]}, "max_trials": 2}, "max_trials", "invalid_value"),
        ({"search_space": {"lora_rank": [2, 4, 8]}}, "search_space", "quota_exceeded"),  # quota: 2 per task
        ({"search_space": {}, "eval_interval": 1}, "eval_interval", "unknown_field"),
    ],
)
def test_the_preview_refuses_what_submission_refuses(client: TestClient, body: dict[str, Any], param: str,
                                                     code: str | None) -> None:
    small = make_tenant(client, "small", max_trials_per_task=2)
    r = client.post("/v1/search-spaces/expand", json=body, headers=small.headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert r.json()["error"]["message"]


def test_the_preview_reports_the_tenants_quota(client: TestClient) -> None:
    small = make_tenant(client, "small", max_trials_per_task=3)
    r = client.post("/v1/search-spaces/expand", json={"search_space": {"lora_rank": [2, 4]}}, headers=small.headers)
    assert (r.json()["count"], r.json()["max_trials_per_task"]) == (2, 3)


def test_the_preview_needs_an_api_key(client: TestClient) -> None:
    r = client.post("/v1/search-spaces/expand", json={"search_space": {}})
    assert r.status_code == 401
