"""Submitting tasks: trials, steps, defaults, quotas, idempotency, and nothing half-written."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from common.bus import SCHEDULER_STREAM, get_bus
from common.messages import Wake
from common.tables import Event, Task, Trial
from tests.factories import ADMIN, TenantKey, chat_rows, count_rows, make_task, make_tenant, task_body, upload


def _trials(client: TestClient, tenant: TenantKey, task_id: str) -> list[dict]:
    return client.get(f"/v1/tasks/{task_id}/trials", headers=tenant.headers).json()["data"]


def test_grid_2x2_makes_4_trials_with_their_hyperparameters_and_steps(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant, chat_rows(10))
    task = make_task(client, tenant, file["id"], seed=7)
    assert task["object"] == "task" and task["id"].startswith("task-") and task["state"] == "queued"
    assert task["trial_counts"] == {"pending": 4, "running": 0, "waiting": 0, "completed": 0, "stopped_early": 0,
                                    "failed": 0, "cancelled": 0}
    assert (task["progress"], task["best_trial"], task["estimated_seconds_left"]) == (0.0, None, None)
    # 10 rows: a tenth would hold out one; the default rule holds out a quarter (common.datasets).
    assert (task["validation_split"], task["epochs"], task["max_steps"], task["max_seq_len"]) == (0.25, 2, None, 512)
    assert task["search_space"] == {
        "learning_rate": [1e-4, 3e-4], "lora_rank": [8, 16], "lora_alpha": None, "batch_size": [4],
        "lora_dropout": [0.0], "target_modules": ["all-linear"],
    }
    trials = _trials(client, tenant, task["id"])
    # 10 rows - 2 held out = 8 train rows; ceil(8 / 4) = 2 steps per epoch; 2 epochs.
    assert [t["total_steps"] for t in trials] == [4, 4, 4, 4]
    assert [(t["index"], t["state"]) for t in trials] == [(i, "pending") for i in range(4)]
    assert [t["hyperparameters"] for t in trials] == [
        {"learning_rate": lr, "lora_rank": r, "lora_alpha": 2.0 * r, "batch_size": 4, "lora_dropout": 0.0,
         "target_modules": "all-linear", "seed": 7 + i}
        for i, (lr, r) in enumerate([(1e-4, 8), (1e-4, 16), (3e-4, 8), (3e-4, 16)])
    ]
    assert task["eval_interval"] == 1  # max(1, 6 // 10)
    # The defaults: cosine after a warm-up of 3% of each trial's steps (null: the worker resolves it per trial).
    assert task["training"] == {"lr_schedule": "cosine", "warmup_steps": None, "weight_decay": 0.0,
                                "max_grad_norm": None, "use_rslora": False, "checkpoints": True,
                                "epoch_checkpoints": None}
    assert task["evaluation"] == {"metric": "loss", "max_new_tokens": 32, "pattern": None}


@pytest.mark.parametrize("space", ["auto", None])
def test_a_task_without_a_search_space_gets_the_auto_grid_for_its_model_and_data(
    client: TestClient, tenant: TenantKey, space: str | None
) -> None:
    file = upload(client, tenant, chat_rows(10))
    body = task_body(file["id"], search_space=space)
    if space is None:
        del body["search_space"]
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert r.status_code == 201, r.text
    task = r.json()
    # tiny-random-llama: a model far below 1B parameters (centre 1e-3), and 9 training rows (ranks 4 and 16).
    assert task["search_space"]["learning_rate"] == [3e-4, 1e-3, 3e-3]
    assert task["search_space"]["lora_rank"] == [4, 16]
    assert task["search_space"]["target_modules"] == ["all-linear"]
    trials = _trials(client, tenant, task["id"])
    assert [(t["hyperparameters"]["learning_rate"], t["hyperparameters"]["lora_rank"]) for t in trials] == [
        (lr, r) for lr in (3e-4, 1e-3, 3e-3) for r in (4, 16)]


def test_training_options_are_stored_with_the_task(client: TestClient, tenant: TenantKey) -> None:
    training = {"lr_schedule": "cosine", "warmup_steps": 3, "weight_decay": 0.01, "max_grad_norm": 1.0,
                "use_rslora": True, "checkpoints": True, "epoch_checkpoints": 2}
    task = make_task(client, tenant, training=training)
    assert task["training"] == training
    assert client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()["training"] == training


@pytest.mark.parametrize(("evaluation", "stored"), [
    ({}, {"metric": "loss", "max_new_tokens": 32, "pattern": None}),
    ({"metric": "exact_match"}, {"metric": "exact_match", "max_new_tokens": 32, "pattern": None}),
    ({"metric": "contains", "max_new_tokens": 1}, {"metric": "contains", "max_new_tokens": 1, "pattern": None}),
    ({"metric": "json_valid", "max_new_tokens": 512}, {"metric": "json_valid", "max_new_tokens": 512,
                                                       "pattern": None}),
    ({"metric": "regex", "pattern": r"^\s*(yes|no)\b"}, {"metric": "regex", "max_new_tokens": 32,
                                                         "pattern": r"^\s*(yes|no)\b"}),
])
def test_evaluation_is_stored_with_its_defaults(client: TestClient, tenant: TenantKey, evaluation: dict,
                                                stored: dict) -> None:
    from common.db import session_scope

    task = make_task(client, tenant, evaluation=evaluation)
    assert task["evaluation"] == stored
    assert client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()["evaluation"] == stored
    with session_scope() as session:
        row = session.get(Task, task["id"])
        assert row is not None and row.spec["evaluation"] == stored  # what the worker reads, via the pack message
    # Every task has validation rows to score (here the default split of a 10-row file: 0.25).
    assert task["validation_split"] == 0.25


def test_a_task_stored_before_evaluation_shows_the_loss_metric(client: TestClient, tenant: TenantKey) -> None:
    from common.db import session_scope

    task = make_task(client, tenant)
    with session_scope() as session:
        row = session.get(Task, task["id"])
        assert row is not None
        row.spec = {k: v for k, v in row.spec.items() if k != "evaluation"}
    shown = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert shown["evaluation"] == {"metric": "loss", "max_new_tokens": 32, "pattern": None}


def test_the_stored_spec_is_exactly_what_task_spec_reads_and_writes(client: TestClient, tenant: TenantKey) -> None:
    """Every field the API stores is a field of `common.task_spec.TaskSpec`: parsing the row and writing it back
    gives the row, so nothing the submission stored is dropped or renamed on the way to the scheduler."""
    from common.db import session_scope

    task = make_task(client, tenant, evaluation={"metric": "regex", "pattern": "a+"}, max_seq_len=256, seed=7,
                     scheduling={"max_trials_per_pack": 3},
                     early_exit={"policy": "asha", "reduction_factor": 3, "num_rungs": 2})
    with session_scope() as session:
        row = session.get(Task, task["id"])
        assert row is not None
        assert row.parsed_spec.to_stored() == row.spec
        spec = row.parsed_spec
    assert (spec.max_seq_len, spec.seed, spec.scheduling.max_trials_per_pack, spec.metric) == (256, 7, 3, "regex")
    assert spec.early_exit == {"policy": "asha", "reduction_factor": 3, "num_rungs": 2}


def test_total_steps_follow_each_trials_batch_size(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant, chat_rows(41))
    task = make_task(client, tenant, file["id"], search_space={"batch_size": [1, 4, 16]}, epochs=3,
                     validation_split=0.25)
    n_train = 41 - 10  # validation_rows(41, 0.25) = round(10.25) = 10
    trials = _trials(client, tenant, task["id"])
    assert [t["total_steps"] for t in trials] == [3 * math.ceil(n_train / b) for b in (1, 4, 16)]
    assert task["eval_interval"] == 93 // 10


def test_max_steps_and_validation_file(client: TestClient, tenant: TenantKey) -> None:
    train, val = upload(client, tenant, chat_rows(10)), upload(client, tenant, chat_rows(3))
    task = make_task(client, tenant, train["id"], validation_file=val["id"], max_steps=50, epochs=None,
                     eval_interval=7, search_space={})
    assert (task["validation_file"], task["validation_split"], task["epochs"], task["max_steps"]) == (
        val["id"], None, None, 50)
    assert task["eval_interval"] == 7
    [trial] = _trials(client, tenant, task["id"])
    assert trial["total_steps"] == 50
    assert trial["hyperparameters"] == {
        "learning_rate": 1e-3, "lora_rank": 8,  # below 1B parameters: common.search_space.default_learning_rate
        "lora_alpha": 16.0, "batch_size": 4, "lora_dropout": 0.0,
        "target_modules": "all-linear", "seed": 0,
    }


def test_ranges_with_num_and_log_scale(client: TestClient) -> None:
    tenant = make_tenant(client, max_trials_per_task=100)
    task = make_task(client, tenant, search_space={
        "learning_rate": {"min": 1e-5, "max": 1e-3, "num": 3, "scale": "log"},
        "lora_rank": {"min": 4, "max": 64, "num": 5, "scale": "log"},
        "lora_dropout": {"min": 0.0, "max": 0.1, "num": 2},
        "target_modules": [["v_proj", "q_proj", "q_proj"], "all-linear"],
    })
    hps = [t["hyperparameters"] for t in _trials(client, tenant, task["id"])]
    assert len(hps) == 3 * 5 * 2 * 2
    assert sorted({h["learning_rate"] for h in hps}) == [1e-5, 1e-4, 1e-3]
    assert sorted({h["lora_rank"] for h in hps}) == [4, 8, 16, 32, 64]
    assert sorted({h["lora_dropout"] for h in hps}) == [0.0, 0.1]
    assert {tuple(h["target_modules"]) if isinstance(h["target_modules"], list) else h["target_modules"]
            for h in hps} == {("q_proj", "v_proj"), "all-linear"}
    assert all(h["lora_alpha"] == 2 * h["lora_rank"] for h in hps)
    assert task["search_space"]["lora_rank"] == {"min": 4, "max": 64, "num": 5, "scale": "log"}


def test_explicit_alpha_is_a_dimension(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, search_space={"lora_rank": [8], "lora_alpha": [8, 32]})
    assert [t["hyperparameters"]["lora_alpha"] for t in _trials(client, tenant, task["id"])] == [8, 32]


def test_random_search_is_reproducible_from_the_seed(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    space = {
        "learning_rate": {"min": 1e-5, "max": 1e-3, "scale": "log"},
        "lora_rank": {"min": 4, "max": 64},
        "batch_size": [2, 4, 8],
        "lora_dropout": {"min": 0.0, "max": 0.2},
    }

    def run(seed: int) -> list[dict]:
        task = make_task(client, tenant, file["id"], strategy="random", max_trials=6, seed=seed, search_space=space)
        assert task["strategy"] == "random" and task["max_trials"] == 6
        return [{k: v for k, v in t["hyperparameters"].items() if k != "seed"}
                for t in _trials(client, tenant, task["id"])]

    first, again, other = run(3), run(3), run(4)
    assert first == again and first != other
    assert len(first) == 6
    for hp in first:
        assert 1e-5 <= hp["learning_rate"] <= 1e-3
        assert isinstance(hp["lora_rank"], int) and 4 <= hp["lora_rank"] <= 64
        assert hp["batch_size"] in (2, 4, 8)
        assert 0.0 <= hp["lora_dropout"] <= 0.2
        assert hp["lora_alpha"] == 2 * hp["lora_rank"]


def test_random_search_drops_duplicates(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, strategy="random", max_trials=10, search_space={"lora_rank": [8, 16]})
    assert sorted(t["hyperparameters"]["lora_rank"] for t in _trials(client, tenant, task["id"])) == [8, 16]


def test_created_task_records_an_event_and_wakes_the_scheduler(client: TestClient, tenant: TenantKey) -> None:
    bus = get_bus()
    tail = bus.tail_id(SCHEDULER_STREAM)
    task = make_task(client, tenant)
    messages = [m for _id, m in bus.read_after(SCHEDULER_STREAM, tail, 100, 0.5)]
    assert Wake(reason="task.created", task_id=task["id"]).to_dict() in messages
    created, small = client.get(f"/v1/tasks/{task['id']}/events", headers=tenant.headers).json()["data"]
    assert (created["type"], created["data"]) == ("task.created", {"trials": 4})
    # 4 trials ranked on 2 held-out rows (a quarter of 10, rounded): warned.
    assert (small["type"], small["level"]) == ("task.small_validation", "warn")
    assert small["data"] == {"validation_rows": 2, "trials": 4, "recommended_rows": 64}


def test_no_small_validation_warning_with_enough_validation_rows_or_one_trial(client: TestClient,
                                                                               tenant: TenantKey) -> None:
    train = upload(client, tenant, chat_rows(10))["id"]
    val = upload(client, tenant, chat_rows(64), filename="val.jsonl")["id"]
    enough = make_task(client, tenant, train, validation_file=val)
    alone = make_task(client, tenant, train, search_space={"learning_rate": [1e-4]})
    for task in (enough, alone):
        types = [e["type"] for e in client.get(f"/v1/tasks/{task['id']}/events", headers=tenant.headers).json()["data"]]
        assert types == ["task.created"]
    # 300 training rows and no split: a quarter held out, 75 rows: no warning either.
    many = make_task(client, tenant, upload(client, tenant, chat_rows(300))["id"])
    assert many["validation_split"] == 0.25
    types = [e["type"] for e in client.get(f"/v1/tasks/{many['id']}/events", headers=tenant.headers).json()["data"]]
    assert types == ["task.created"]


def test_trials_per_task_quota_is_422(client: TestClient) -> None:
    small = make_tenant(client, max_trials_per_task=3)
    file = upload(client, small)
    r = client.post("/v1/tasks", headers=small.headers, json=task_body(file["id"]))
    assert r.status_code == 422
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("quota_exceeded", "search_space")
    r = client.post("/v1/tasks", headers=small.headers,
                    json=task_body(file["id"], strategy="random", max_trials=4))
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (422, "quota_exceeded",
                                                                                       "max_trials")
    assert count_rows(Task) == 0


def test_concurrent_trials_quota_is_429_until_trials_finish(client: TestClient) -> None:
    small = make_tenant(client, max_concurrent_trials=5)
    file = upload(client, small)
    first = make_task(client, small, file["id"])  # 4 trials
    r = client.post("/v1/tasks", headers=small.headers,
                    json=task_body(file["id"], search_space={"lora_rank": [4, 8]}))
    assert r.status_code == 429
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("rate_limit_error", "quota_exceeded")
    assert count_rows(Task) == 1

    client.post(f"/v1/tasks/{first['id']}/cancel", headers=small.headers)
    r = client.post("/v1/tasks", headers=small.headers,
                    json=task_body(file["id"], search_space={"lora_rank": [4, 8]}))
    assert r.status_code == 201


def test_idempotency_key_returns_the_first_task(client: TestClient, tenant: TenantKey, other_tenant: TenantKey) -> None:
    file = upload(client, tenant)
    headers = {**tenant.headers, "Idempotency-Key": "req-1"}
    first = client.post("/v1/tasks", headers=headers, json=task_body(file["id"]))
    again = client.post("/v1/tasks", headers=headers, json=task_body(file["id"]))
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert count_rows(Task) == 1 and count_rows(Trial) == 4

    other = client.post("/v1/tasks", headers={**tenant.headers, "Idempotency-Key": "req-2"},
                        json=task_body(file["id"]))
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]

    other_file = upload(client, other_tenant)
    theirs = client.post("/v1/tasks", headers={**other_tenant.headers, "Idempotency-Key": "req-1"},
                         json=task_body(other_file["id"]))
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]


def test_failed_validation_leaves_no_rows_and_no_wakeup(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    bus = get_bus()
    tail = bus.tail_id(SCHEDULER_STREAM)
    r = client.post("/v1/tasks", headers=tenant.headers,
                    json=task_body(file["id"], search_space={"learning_rate": [1e-4, 5.0]}))
    assert r.status_code == 422
    r = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file["id"], base_model="nope"))
    assert r.status_code == 422
    assert (count_rows(Task), count_rows(Trial), count_rows(Event)) == (0, 0, 0)
    assert bus.read_after(SCHEDULER_STREAM, tail, 100, 0.05) == []


def test_failure_while_writing_rolls_everything_back(
    clean_db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from api.main import create_app

    def broken_event(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("crash after the task and trials were added")

    with TestClient(create_app(), raise_server_exceptions=False) as c:
        tenant = make_tenant(c)
        file = upload(c, tenant)
        monkeypatch.setattr("api.services.tasks.record_event", broken_event)
        r = c.post("/v1/tasks", headers=tenant.headers, json=task_body(file["id"]))
    assert r.status_code == 500
    assert (count_rows(Task), count_rows(Trial), count_rows(Event)) == (0, 0, 0)


def test_admin_can_raise_a_quota_and_the_next_task_fits(client: TestClient) -> None:
    small = make_tenant(client, max_trials_per_task=1)
    file = upload(client, small)
    assert client.post("/v1/tasks", headers=small.headers, json=task_body(file["id"])).status_code == 422
    client.patch(f"/v1/admin/tenants/{small.id}", json={"max_trials_per_task": 4}, headers=ADMIN)
    assert client.post("/v1/tasks", headers=small.headers, json=task_body(file["id"])).status_code == 201
