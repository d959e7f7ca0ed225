"""`/v1/fine-tunes` at the API (Together AI's client's journey: tests/e2e/test_together_sdk.py): a fine-tune request,
as the client sends it, becomes the task it describes (Together's fields, a list a search), a task reads as
Together's fine-tune, and what loraplane cannot honour is a 422 naming the field, nothing created."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from common.tables import Task
from tests.api.test_api_tasks_dpo import preference_file
from tests.factories import TenantKey, count_rows, prompt_rows, upload

# What `client.fine_tuning.create(training_file=..., model=..., lora=True)` sends by default (together 3.1.1's
# create_finetune_request(...).model_dump(exclude_none=True), with the limits below).
SDK_DEFAULTS: dict[str, Any] = {
    "validation_file": "", "packing": True, "n_epochs": 1, "learning_rate": 1e-05,
    "lr_scheduler": {"lr_scheduler_type": "cosine", "lr_scheduler_args": {"min_lr_ratio": 0.0, "num_cycles": 0.5}},
    "warmup_ratio": 0.0, "max_grad_norm": 1.0, "weight_decay": 0.0, "n_checkpoints": 1, "n_evals": 0,
    "batch_size": "max", "early_stopping_enabled": False,
    "training_type": {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_trainable_modules": "all-linear",
                      "type": "Lora"},
    "training_method": {"method": "sft", "train_on_inputs": "auto"},
}


def _create(client: TestClient, tenant: TenantKey, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/fine-tunes", headers=tenant.headers, json={"model": "tiny-random-llama", **SDK_DEFAULTS,
                                                                      **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _task(client: TestClient, tenant: TenantKey, task_id: str) -> dict[str, Any]:
    return dict(client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).json())


def test_the_clients_first_calls_limits_and_price(client: TestClient, tenant: TenantKey) -> None:
    limits = client.get("/v1/fine-tunes/models/limits", headers=tenant.headers,
                        params={"model_name": "tiny-random-llama"})
    assert limits.status_code == 200, limits.text
    body = limits.json()
    assert body["model_name"] == "tiny-random-llama" and body["lora_training"]["default_rank"] == 8
    assert body["max_seq_length_sft"] == 2048 and not body["supports_full_training"] and body["full_training"] is None
    assert "q_proj" in body["lora_training"]["target_modules"]
    unknown = client.get("/v1/fine-tunes/models/limits", headers=tenant.headers, params={"model_name": "nope"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (422, "unknown_model")
    price = client.post("/v1/fine-tunes/estimate-price", headers=tenant.headers, json={"training_file": "file-x"})
    assert price.json()["estimation_available"] is False


def test_a_fine_tune_is_its_task_in_togethers_shape(client: TestClient, tenant: TenantKey) -> None:
    training = upload(client, tenant, prompt_rows(40))["id"]
    job = _create(client, tenant, training_file=training, suffix="v1", random_seed=9, n_epochs=3, batch_size=8,
                  learning_rate=2e-3, max_seq_length=256, warmup_ratio=0.03, max_grad_norm=0.0, weight_decay=0.01,
                  lr_scheduler={"lr_scheduler_type": "linear", "lr_scheduler_args": {"min_lr_ratio": 0.0}},
                  training_type={"type": "Lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.1,
                                 "lora_trainable_modules": "q_proj, v_proj"})
    assert job["id"].startswith("task-") and job["status"] == "queued" and job["user_id"] == tenant.id
    assert job["model_output_name"] == job["id"] and job["model"] == "tiny-random-llama"
    assert (job["training_file"], job["validation_file"], job["suffix"], job["random_seed"]) == (
        training, None, "v1", 9)
    assert (job["n_epochs"], job["batch_size"], job["learning_rate"], job["max_seq_length"]) == (3, 8, 2e-3, 256)
    assert job["training_type"] == {"type": "Lora", "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.1,
                                    "lora_trainable_modules": "q_proj,v_proj"}
    assert job["training_method"] == {"method": "sft", "train_on_inputs": "auto"}
    assert job["lr_scheduler"]["lr_scheduler_type"] == "linear" and job["warmup_ratio"] == 0.03
    assert (job["max_grad_norm"], job["weight_decay"]) == (0.0, 0.01)
    task = _task(client, tenant, job["id"])
    assert (task["epochs"], task["seed"], task["max_seq_len"], task["suffix"]) == (3, 9, 256, "v1")
    assert task["search_space"] == {"learning_rate": [2e-3], "batch_size": [8], "lora_rank": [4], "lora_alpha": [8.0],
                                    "lora_dropout": [0.1], "target_modules": [["q_proj", "v_proj"]]}
    assert task["training"]["lr_schedule"] == "linear" and task["training"]["warmup_steps"] is None
    assert task["training"]["max_grad_norm"] is None and task["training"]["weight_decay"] == 0.01
    got = client.get(f"/v1/fine-tunes/{job['id']}", headers=tenant.headers).json()
    assert got["id"] == job["id"] and got["events"][0]["type"] == "job_pending"
    assert got["events"][0]["object"] == "fine-tune-event" and got["events"][0]["loraplane"]["type"] == "task.created"


def test_the_clients_defaults_map_to_togethers_meaning(client: TestClient, tenant: TenantKey) -> None:
    """No warm-up (warmup_ratio 0), clipping at 1.0, cosine, the service's batch size for "max"."""
    job = _create(client, tenant, training_file=upload(client, tenant, prompt_rows(40))["id"])
    task = _task(client, tenant, job["id"])
    assert task["training"]["warmup_steps"] == 0 and task["training"]["max_grad_norm"] == 1.0
    assert task["training"]["lr_schedule"] == "cosine" and task["search_space"]["batch_size"] == [4]
    assert task["validation_file"] is None and job["batch_size"] == 4 and job["warmup_ratio"] == 0.0


def test_a_list_makes_the_fine_tune_a_search(client: TestClient, tenant: TenantKey) -> None:
    training = upload(client, tenant, prompt_rows(40))["id"]
    job = _create(client, tenant, training_file=training, learning_rate=[1e-3, 2e-3],
                  training_type={"type": "Lora", "lora_r": [4, 8]})
    assert job["learning_rate"] == [1e-3, 2e-3] and job["training_type"]["lora_r"] == [4, 8]
    assert job["loraplane"]["trial_counts"]["pending"] == 4
    listed = client.get("/v1/fine-tunes", headers=tenant.headers).json()["data"]
    assert [j["id"] for j in listed] == [job["id"]]


def test_a_dpo_fine_tune_is_a_dpo_task(client: TestClient, tenant: TenantKey) -> None:
    job = _create(client, tenant, training_file=preference_file(client, tenant),
                  training_method={"method": "dpo", "dpo_beta": 0.2, "dpo_normalize_logratios_by_length": False,
                                   "dpo_reference_free": False})
    assert job["training_method"] == {"method": "dpo", "dpo_beta": 0.2}
    task = _task(client, tenant, job["id"])
    assert task["objective"]["type"] == "dpo" and task["search_space"]["beta"] == [0.2]


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"training_type": {"type": "Full"}}, "training_type.type", "unsupported_field"),
    ({"packing": False}, "packing", "unsupported_field"),
    ({"from_checkpoint": "ft-1:10"}, "from_checkpoint", "unsupported_field"),
    ({"from_hf_model": "org/model"}, "from_hf_model", "unsupported_field"),
    ({"hf_output_repo_name": "org/out"}, "hf_output_repo_name", "unsupported_field"),
    ({"multimodal_params": {"train_vision": True}}, "multimodal_params.train_vision", "unsupported_field"),
    ({"early_stopping_enabled": True}, "early_stopping_enabled", "unsupported_field"),
    ({"early_stopping_patience": 2}, "early_stopping_patience", "unsupported_field"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps", "unsupported_field"),
    ({"warmup_ratio": 0.1}, "warmup_ratio", "unsupported_field"),
    ({"lr_scheduler": {"lr_scheduler_type": "cosine", "lr_scheduler_args": {"min_lr_ratio": 0.1}}},
     "lr_scheduler.lr_scheduler_args.min_lr_ratio", "unsupported_field"),
    ({"training_method": {"method": "sft", "train_on_inputs": True}}, "training_method.train_on_inputs",
     "unsupported_field"),
    ({"training_method": {"method": "dpo", "rpo_alpha": 0.5}}, "training_method.rpo_alpha", "unsupported_field"),
    ({"training_method": {"method": "dpo", "simpo_gamma": 1.0}}, "training_method.simpo_gamma", "unsupported_field"),
    ({"training_method": {"method": "dpo", "dpo_normalize_logratios_by_length": True}},
     "training_method.dpo_normalize_logratios_by_length", "unsupported_field"),
    ({"training_method": {"method": "sft", "dpo_beta": 0.1}}, "training_method.dpo_beta", "unsupported_field"),
    ({"wandb_base_url": "https://wandb.example"}, "wandb_base_url", "unsupported_field"),
    ({"training_method": {"method": "ppo"}}, "training_method.method", "invalid_value"),
    ({"n_epochs": 0}, "n_epochs", "invalid_value"),
    ({"learning_rate": 2.0}, "learning_rate[0]", "invalid_value"),
    ({"training_type": {"type": "Lora", "lora_r": 512}}, "training_type.lora_r[0]", "invalid_value"),
    ({"training_type": {"type": "Lora", "lora_trainable_modules": "q_proj,wq"}},
     "training_type.lora_trainable_modules[0][1]", "invalid_value"),
    ({"max_seq_length": 4}, "max_seq_length", "invalid_value"),
    ({"wandb_project_name": "p"}, "wandb_key", "invalid_value"),
    ({"model": "gpt-4o-mini"}, "base_model", "unknown_model"),
    ({"model": None}, "model", "missing_field"),
    ({"n_evil": 1}, "n_evil", "unknown_field"),
])
def test_what_cannot_be_honoured_is_refused(client: TestClient, tenant: TenantKey, body: dict[str, Any], param: str,
                                            code: str) -> None:
    training = upload(client, tenant, prompt_rows(40))["id"]
    before = count_rows(Task)
    r = client.post("/v1/fine-tunes", headers=tenant.headers,
                    json={**SDK_DEFAULTS, "model": "tiny-random-llama", "training_file": training, **body})
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (422, param, code), r.text
    assert count_rows(Task) == before


def test_events_checkpoints_and_cancel(client: TestClient, tenant: TenantKey) -> None:
    job = _create(client, tenant, training_file=upload(client, tenant, prompt_rows(40))["id"])
    cancelled = client.post(f"/v1/fine-tunes/{job['id']}/cancel", headers=tenant.headers).json()
    assert cancelled["status"] == "cancelled"
    again = client.post(f"/v1/fine-tunes/{job['id']}/cancel", headers=tenant.headers)
    assert (again.status_code, again.json()["error"]["code"]) == (409, "task_finished")
    events = client.get(f"/v1/fine-tunes/{job['id']}/events", headers=tenant.headers).json()["data"]
    assert [e["type"] for e in events][0] == "job_pending" and events[-1]["type"] == "job_stopped"
    assert client.get(f"/v1/fine-tunes/{job['id']}/checkpoints", headers=tenant.headers).json() == {"data": []}
    missing = client.get("/v1/fine-tunes/task-missing", headers=tenant.headers)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "task_not_found")
