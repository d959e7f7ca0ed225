"""Every invalid task field is a 4xx naming the field, and nothing is written."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from common.tables import Task, Trial
from tests.factories import TenantKey, count_rows, task_body, upload

RANGE = {"min": 1e-5, "max": 1e-3, "num": 3}

# (case id, changes to a valid body (None removes the key), status, param, code)
CASES: list[tuple[str, dict[str, Any], int, str | None, str]] = [
    ("unknown-field", {"colour": "red"}, 422, "colour", "unknown_field"),
    ("no-base-model", {"base_model": None}, 422, "base_model", "missing_field"),
    ("unknown-model", {"base_model": "gpt-9"}, 422, "base_model", "unknown_model"),
    ("no-training-file", {"training_file": None}, 422, "training_file", "missing_field"),
    ("missing-training-file", {"training_file": "file-0000"}, 422, "training_file", "invalid_file"),
    ("missing-validation-file", {"validation_file": "file-0000"}, 422, "validation_file", "invalid_file"),
    ("file-and-split", {"validation_file": "@file", "validation_split": 0.2}, 422, "validation_split",
     "conflicting_fields"),
    ("split-zero", {"validation_split": 0}, 422, "validation_split", "invalid_value"),
    ("split-too-big", {"validation_split": 0.6}, 422, "validation_split", "invalid_value"),
    ("epochs-zero", {"epochs": 0}, 422, "epochs", "invalid_value"),
    ("epochs-too-many", {"epochs": 101}, 422, "epochs", "invalid_value"),
    ("epochs-string", {"epochs": "2"}, 422, "epochs", "invalid_value"),
    ("max-steps-zero", {"max_steps": 0, "epochs": None}, 422, "max_steps", "invalid_value"),
    ("epochs-and-steps", {"max_steps": 10}, 422, "max_steps", "conflicting_fields"),
    ("seq-len-small", {"max_seq_len": 8}, 422, "max_seq_len", "invalid_value"),
    ("seq-len-big", {"max_seq_len": 9000}, 422, "max_seq_len", "invalid_value"),
    ("eval-interval-zero", {"eval_interval": 0}, 422, "eval_interval", "invalid_value"),
    ("seed-negative", {"seed": -1}, 422, "seed", "invalid_value"),
    ("strategy", {"strategy": "bayes"}, 422, "strategy", "invalid_value"),
    ("random-no-max", {"strategy": "random"}, 422, "max_trials", "missing_field"),
    ("grid-over-max", {"max_trials": 3}, 422, "max_trials", "invalid_value"),
    ("max-trials-zero", {"max_trials": 0}, 422, "max_trials", "invalid_value"),
    ("policy-unknown", {"early_exit": {"policy": "median"}}, 422, "early_exit.policy", "invalid_value"),
    ("policy-null", {"early_exit": {"policy": None}}, 422, "early_exit.policy", "invalid_value"),
    ("early-exit-extra", {"early_exit": {"policy": "none", "w": 2}}, 422, "early_exit.w", "unknown_field"),
    ("early-exit-string", {"early_exit": "alto"}, 422, "early_exit", "invalid_value"),
    ("alto-unknown", {"early_exit": {"policy": "alto", "patience": 3}}, 422, "early_exit.patience", "unknown_field"),
    ("asha-gets-alto-param", {"early_exit": {"policy": "asha", "window": 3}}, 422, "early_exit.window",
     "unknown_field"),
    ("none-gets-param", {"early_exit": {"keep_ratio": 0.5}}, 422, "early_exit.keep_ratio", "unknown_field"),
    ("alto-window-one", {"early_exit": {"policy": "alto", "window": 1}}, 422, "early_exit.window", "invalid_value"),
    ("alto-window-float", {"early_exit": {"policy": "alto", "window": 2.5}}, 422, "early_exit.window",
     "invalid_value"),
    ("alto-patience-zero", {"early_exit": {"policy": "alto", "patience_div": 0}}, 422, "early_exit.patience_div",
     "invalid_value"),
    ("alto-slope-negative", {"early_exit": {"policy": "alto", "tau_slope": -0.1}}, 422, "early_exit.tau_slope",
     "invalid_value"),
    ("alto-gap-string", {"early_exit": {"policy": "alto", "tau_gap": "0.1"}}, 422, "early_exit.tau_gap",
     "invalid_value"),
    ("alto-warmup-zero", {"early_exit": {"policy": "alto", "warmup_ratio": 0}}, 422, "early_exit.warmup_ratio",
     "invalid_value"),
    ("alto-warmup-big", {"early_exit": {"policy": "alto", "warmup_ratio": 0.6}}, 422, "early_exit.warmup_ratio",
     "invalid_value"),
    ("alto-keep-big", {"early_exit": {"policy": "alto", "keep_ratio": 1.5}}, 422, "early_exit.keep_ratio",
     "invalid_value"),
    ("alto-alpha-zero", {"early_exit": {"policy": "alto", "ema_alpha": 0}}, 422, "early_exit.ema_alpha",
     "invalid_value"),
    ("asha-eta-one", {"early_exit": {"policy": "asha", "reduction_factor": 1}}, 422, "early_exit.reduction_factor",
     "invalid_value"),
    ("asha-rungs-zero", {"early_exit": {"policy": "asha", "num_rungs": 0}}, 422, "early_exit.num_rungs",
     "invalid_value"),
    ("schedule-unknown", {"training": {"lr_schedule": "step"}}, 422, "training.lr_schedule", "invalid_value"),
    ("warmup-negative", {"training": {"warmup_steps": -1}}, 422, "training.warmup_steps", "invalid_value"),
    ("decay-too-big", {"training": {"weight_decay": 2.0}}, 422, "training.weight_decay", "invalid_value"),
    ("clip-zero", {"training": {"max_grad_norm": 0.0}}, 422, "training.max_grad_norm", "invalid_value"),
    ("rslora-string", {"training": {"use_rslora": "yes"}}, 422, "training.use_rslora", "invalid_value"),
    ("training-extra", {"training": {"optimizer": "sgd"}}, 422, "training.optimizer", "unknown_field"),
    ("pack-zero", {"scheduling": {"max_trials_per_pack": 0}}, 422, "scheduling.max_trials_per_pack",
     "invalid_value"),
    ("pack-big", {"scheduling": {"max_trials_per_pack": 65}}, 422, "scheduling.max_trials_per_pack",
     "invalid_value"),
    ("metric-unknown", {"evaluation": {"metric": "bleu"}}, 422, "evaluation.metric", "invalid_value"),
    ("metric-null", {"evaluation": {"metric": None}}, 422, "evaluation.metric", "invalid_value"),
    ("evaluation-string", {"evaluation": "exact_match"}, 422, "evaluation", "invalid_value"),
    ("evaluation-extra", {"evaluation": {"metric": "contains", "temperature": 0.7}}, 422, "evaluation.temperature",
     "unknown_field"),
    ("regex-no-pattern", {"evaluation": {"metric": "regex"}}, 422, "evaluation.pattern", "missing_field"),
    ("regex-bad-pattern", {"evaluation": {"metric": "regex", "pattern": "(unclosed"}}, 422, "evaluation.pattern",
     "invalid_regex"),
    ("regex-bad-escape", {"evaluation": {"metric": "regex", "pattern": "\\"}}, 422, "evaluation.pattern",
     "invalid_regex"),
    ("regex-repeat-too-large", {"evaluation": {"metric": "regex", "pattern": "a{99999999999}"}}, 422,
     "evaluation.pattern", "regex_too_complex"),
    ("regex-repeat-over-policy", {"evaluation": {"metric": "regex", "pattern": "a{1000000000}"}}, 422,
     "evaluation.pattern", "regex_too_complex"),
    ("regex-verbose-spaced-count", {"evaluation": {"metric": "regex", "pattern": "(?x)a{1 000 000 000}"}}, 422,
     "evaluation.pattern", "invalid_regex"),
    ("regex-lookahead", {"evaluation": {"metric": "regex", "pattern": "(?=a)b"}}, 422, "evaluation.pattern",
     "invalid_regex"),
    ("regex-empty-pattern", {"evaluation": {"metric": "regex", "pattern": ""}}, 422, "evaluation.pattern",
     "invalid_value"),
    ("regex-pattern-too-long", {"evaluation": {"metric": "regex", "pattern": "a" * 501}}, 422, "evaluation.pattern",
     "invalid_value"),
    ("regex-pattern-not-string", {"evaluation": {"metric": "regex", "pattern": 1}}, 422, "evaluation.pattern",
     "invalid_value"),
    ("regex-pattern-control-char", {"evaluation": {"metric": "regex", "pattern": "a\nb"}}, 422,
     "evaluation.pattern", "invalid_characters"),
    ("pattern-for-exact-match", {"evaluation": {"metric": "exact_match", "pattern": "\\d+"}}, 422,
     "evaluation.pattern", "unknown_field"),
    ("pattern-for-loss", {"evaluation": {"pattern": "\\d+"}}, 422, "evaluation.pattern", "unknown_field"),
    ("new-tokens-zero", {"evaluation": {"metric": "exact_match", "max_new_tokens": 0}}, 422,
     "evaluation.max_new_tokens", "invalid_value"),
    ("new-tokens-over-limit", {"evaluation": {"metric": "exact_match", "max_new_tokens": 513}}, 422,
     "evaluation.max_new_tokens", "invalid_value"),
    ("new-tokens-float", {"evaluation": {"metric": "contains", "max_new_tokens": 16.0}}, 422,
     "evaluation.max_new_tokens", "invalid_value"),
    ("generative-split-zero", {"evaluation": {"metric": "exact_match"}, "validation_split": 0}, 422,
     "validation_split", "invalid_value"),
    ("space-other-word", {"search_space": "grid"}, 422, "search_space", "invalid_value"),
    ("space-null", {"search_space": "@null"}, 422, "search_space", "invalid_value"),
    ("space-not-object", {"search_space": [1]}, 422, "search_space", "invalid_value"),
    ("space-unknown-dim", {"search_space": {"rank": [8]}}, 422, "search_space.rank", "unknown_field"),
    ("lr-too-big", {"search_space": {"learning_rate": [1e-4, 2]}}, 422, "search_space.learning_rate[1]",
     "invalid_value"),
    ("lr-zero", {"search_space": {"learning_rate": [0]}}, 422, "search_space.learning_rate[0]", "invalid_value"),
    ("lr-string", {"search_space": {"learning_rate": ["1e-4"]}}, 422, "search_space.learning_rate[0]",
     "invalid_value"),
    ("lr-bool", {"search_space": {"learning_rate": [True]}}, 422, "search_space.learning_rate[0]", "invalid_value"),
    ("lr-scalar", {"search_space": {"learning_rate": 1e-4}}, 422, "search_space.learning_rate", "invalid_value"),
    ("lr-empty", {"search_space": {"learning_rate": []}}, 422, "search_space.learning_rate", "invalid_value"),
    ("rank-zero", {"search_space": {"lora_rank": [8, 0]}}, 422, "search_space.lora_rank[1]", "invalid_value"),
    ("rank-big", {"search_space": {"lora_rank": [512]}}, 422, "search_space.lora_rank[0]", "invalid_value"),
    ("rank-fraction", {"search_space": {"lora_rank": [8.5]}}, 422, "search_space.lora_rank[0]", "invalid_value"),
    ("alpha-zero", {"search_space": {"lora_alpha": [16, 0]}}, 422, "search_space.lora_alpha[1]", "invalid_value"),
    ("batch-zero", {"search_space": {"batch_size": [0]}}, 422, "search_space.batch_size[0]", "invalid_value"),
    ("batch-big", {"search_space": {"batch_size": [2048]}}, 422, "search_space.batch_size[0]", "invalid_value"),
    ("dropout-one", {"search_space": {"lora_dropout": [0.1, 1.0]}}, 422, "search_space.lora_dropout[1]",
     "invalid_value"),
    ("dropout-negative", {"search_space": {"lora_dropout": [-0.1]}}, 422, "search_space.lora_dropout[0]",
     "invalid_value"),
    ("module-unknown", {"search_space": {"target_modules": [["q_proj", "lm_head"]]}}, 422,
     "search_space.target_modules[0][1]", "invalid_value"),
    ("module-empty-choice", {"search_space": {"target_modules": [[]]}}, 422, "search_space.target_modules[0]",
     "invalid_value"),
    ("module-bad-string", {"search_space": {"target_modules": "everything"}}, 422, "search_space.target_modules",
     "invalid_value"),
    ("module-bad-choice", {"search_space": {"target_modules": [["q_proj"], "q_proj"]}}, 422,
     "search_space.target_modules[1]", "invalid_value"),
    ("module-range", {"search_space": {"target_modules": {"min": 1, "max": 2}}}, 422, "search_space.target_modules",
     "invalid_value"),
    ("grid-range-no-num", {"search_space": {"learning_rate": {"min": 1e-5, "max": 1e-3}}}, 422,
     "search_space.learning_rate.num", "invalid_value"),
    ("range-reversed", {"search_space": {"learning_rate": {**RANGE, "min": 1e-2}}}, 422,
     "search_space.learning_rate", "invalid_value"),
    ("range-out-of-bounds", {"search_space": {"learning_rate": {**RANGE, "max": 2}}}, 422,
     "search_space.learning_rate.max", "invalid_value"),
    ("range-scale", {"search_space": {"learning_rate": {**RANGE, "scale": "cubic"}}}, 422,
     "search_space.learning_rate.scale", "invalid_value"),
    ("range-extra", {"search_space": {"learning_rate": {**RANGE, "step": 1}}}, 422,
     "search_space.learning_rate.step", "unknown_field"),
    ("range-num-zero", {"search_space": {"learning_rate": {**RANGE, "num": 0}}}, 422,
     "search_space.learning_rate.num", "invalid_value"),
    ("rank-range-fraction", {"search_space": {"lora_rank": {"min": 4.5, "max": 8, "num": 2}}}, 422,
     "search_space.lora_rank.min", "invalid_value"),
    ("log-range-from-zero", {"search_space": {"lora_dropout": {"min": 0.0, "max": 0.1, "num": 2, "scale": "log"}}},
     422, "search_space.lora_dropout", "invalid_value"),
]


@pytest.mark.parametrize(("changes", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_task_field_is_rejected_naming_the_field(
    client: TestClient, tenant: TenantKey, changes: dict[str, Any], status: int, param: str | None, code: str
) -> None:
    file = upload(client, tenant)
    body = task_body(file["id"])
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = file["id"] if value == "@file" else None if value == "@null" else value
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error"
    assert (count_rows(Task), count_rows(Trial)) == (0, 0)


def test_foreign_file_gets_the_same_answer_as_a_missing_one(
    client: TestClient, tenant: TenantKey, other_tenant: TenantKey
) -> None:
    theirs = upload(client, other_tenant)
    upload(client, tenant)
    foreign = client.post("/v1/tasks", headers=tenant.headers, json=task_body(theirs["id"]))
    missing = client.post("/v1/tasks", headers=tenant.headers, json=task_body("file-0123456789abcdef0123"))
    assert foreign.status_code == missing.status_code == 422

    def scrub(body: dict, file_id: str) -> dict:
        return {**body["error"], "message": body["error"]["message"].replace(file_id, "<id>")}

    assert scrub(foreign.json(), theirs["id"]) == scrub(missing.json(), "file-0123456789abcdef0123")


def test_one_row_file_cannot_be_split(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant, b'{"prompt": "a", "completion": "b"}\n')
    r = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file["id"]))
    assert (r.status_code, r.json()["error"]["param"]) == (422, "training_file")
    assert "validation_file" in r.json()["error"]["message"]


def test_a_generative_metric_on_a_file_too_small_to_split_is_refused(client: TestClient, tenant: TenantKey) -> None:
    """A generative metric scores answers to validation rows: a task always has some (a validation_file, or a
    split > 0 that holds out at least one row), so it is refused where it would have none."""
    file = upload(client, tenant, b'{"prompt": "a", "completion": "b"}\n')
    body = task_body(file["id"], evaluation={"metric": "exact_match"})
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (422, "training_file",
                                                                                      "invalid_file")
    assert (count_rows(Task), count_rows(Trial)) == (0, 0)


def test_a_bad_regex_is_a_422_in_the_one_error_shape(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    r = client.post("/v1/tasks", headers=tenant.headers,
                    json=task_body(file["id"], evaluation={"metric": "regex", "pattern": "[a-"}))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["message"].startswith("evaluation.pattern: Not a valid RE2 regular expression: ")
    assert error["errors"] == [{"param": "evaluation.pattern", "code": "invalid_regex", "message": error["message"]
                                .removeprefix("evaluation.pattern: ")}]


def test_validation_errors_list_every_problem(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    body = task_body(file["id"], epochs=0, search_space={"lora_rank": [0, 300]})
    error = client.post("/v1/tasks", headers=tenant.headers, json=body).json()["error"]
    assert {e["param"] for e in error["errors"]} == {
        "search_space.lora_rank[0]", "search_space.lora_rank[1]", "epochs"}


def test_idempotency_key_too_long_is_422(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    r = client.post("/v1/tasks", headers={**tenant.headers, "Idempotency-Key": "k" * 201},
                    json=task_body(file["id"]))
    assert (r.status_code, r.json()["error"]["param"]) == (422, "Idempotency-Key")
