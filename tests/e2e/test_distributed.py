"""The distributed mode end to end: `loraplane api`, `loraplane scheduler` and `loraplane worker` as
separate processes against the real PostgreSQL, Redis (bus and Celery broker) and artifact directory."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, MODEL_CACHE
from tests.e2e.flow import (
    arithmetic_rows,
    assert_adapter_changes_output,
    create_tenant_key,
    download_adapter,
    follow_events,
    grid_task,
    submit,
    upload,
    wait_for,
)
from tests.e2e.procs import Cluster, cluster, free_port, wait_ready
from tests.services import MissingService, find_rabbitmq


@pytest.fixture
def env(clean_db: None, tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e.update({
        "LORAPLANE_NAMESPACE": f"lp-e2e-{uuid.uuid4().hex[:8]}",
        "LORAPLANE_HOME": str(tmp_path / "home"),
        "LORAPLANE_ARTIFACT_DIR": str(tmp_path / "artifacts"),
        "LORAPLANE_SCHEDULER_TICK_S": "0.5",
        "LORAPLANE_HEARTBEAT_S": "1",
        "LORAPLANE_WORKER_TIMEOUT_S": "8",
    })
    return e


@pytest.fixture(params=["redis"])
def services(request: pytest.FixtureRequest, env: dict[str, str], tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    if request.param == "rabbitmq":
        try:
            env["CELERY_BROKER_URL"] = find_rabbitmq()
        except MissingService as exc:
            pytest.skip(str(exc))
    port = free_port()
    with cluster(env, tmp_path) as c:
        api = c.start("api", "api", "--host", "127.0.0.1", "--port", str(port))
        c.start("scheduler", "scheduler")
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, [api])
        yield c, base_url


@pytest.mark.parametrize("services", ["redis", "rabbitmq"], indirect=True)
def test_grid_task_end_to_end(services: tuple[Cluster, str], tmp_path: Path) -> None:
    c, base_url = services
    worker = c.start("worker-a", "worker", "--worker-id", "e2e-a")
    headers = create_tenant_key(base_url, ADMIN_TOKEN, "team-e2e")
    file_id = upload(base_url, headers, arithmetic_rows())
    task = submit(base_url, headers, grid_task(file_id))
    assert task["state"] == "queued"

    events = follow_events(base_url, headers, task["id"], timeout_s=300)
    types = [e["event"] for e in events]
    assert types[0] == "task.created" and types[-1] == "end", types
    assert events[-1]["data"]["state"] == "succeeded", events[-1]
    assert types.count("trial.completed") == 4 and "task.succeeded" in types

    task = httpx.get(f"{base_url}/v1/tasks/{task['id']}", headers=headers).json()
    assert task["state"] == "succeeded" and task["progress"] == 1.0
    assert task["trial_counts"]["completed"] == 4
    trials = httpx.get(f"{base_url}/v1/tasks/{task['id']}/trials", headers=headers).json()["data"]
    val_losses = {t["id"]: t["best_val_loss"] for t in trials}
    assert task["best_trial"]["id"] == min(val_losses, key=lambda k: val_losses[k])
    for trial in trials:
        metrics = httpx.get(f"{base_url}/v1/tasks/{task['id']}/trials/{trial['id']}/metrics", headers=headers).json()
        assert [p["step"] for p in metrics["train"]] == list(range(1, 7))
        assert [p["step"] for p in metrics["val"]] == [3, 6]

    adapter = download_adapter(base_url, headers, f"/v1/tasks/{task['id']}/adapter", tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    best_hp = next(t["hyperparameters"] for t in trials if t["id"] == task["best_trial"]["id"])
    assert config["r"] == best_hp["lora_rank"] and config["peft_type"] == "LORA"
    assert_adapter_changes_output(adapter, "tiny-random-llama", MODEL_CACHE)
    broker_scheme = c.env["CELERY_BROKER_URL"].split("://")[0]  # the pack really went through this broker
    assert f".> transport:   {broker_scheme}://" in worker.log_path.read_text()


def test_killed_worker_and_scheduler_lose_nothing(services: tuple[Cluster, str]) -> None:
    c, base_url = services
    worker_a = c.start("worker-a", "worker", "--worker-id", "e2e-kill-a")
    headers = create_tenant_key(base_url, ADMIN_TOKEN, "team-crash")
    file_id = upload(base_url, headers, arithmetic_rows())
    body = grid_task(file_id, max_steps=150)
    body["eval_interval"] = 50
    task_id = submit(base_url, headers, body)["id"]

    def training_started() -> bool:
        trials = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials", headers=headers).json()["data"]
        return any(t["steps_done"] > 0 for t in trials)

    wait_for(training_started, 180, "the first loss points")
    scheduler = next(p for p in c.procs if p.name == "scheduler")
    worker_a.kill()
    scheduler.kill()
    c.start("scheduler-2", "scheduler")
    c.start("worker-b", "worker", "--worker-id", "e2e-kill-b")

    events = follow_events(base_url, headers, task_id, timeout_s=400)
    assert events[-1]["data"]["state"] == "succeeded", [e["event"] for e in events]
    requeued = [e for e in events if e["event"] == "trial.requeued"]
    assert requeued and all("e2e-kill-a" in e["data"]["message"] for e in requeued)
    trials = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials", headers=headers).json()["data"]
    assert all(t["state"] == "completed" and t["steps_done"] == 150 for t in trials)
    assert {t["attempts"] for t in trials} >= {2}
    for trial in trials:  # the curve restarted cleanly: one point per step, no leftovers of attempt one
        metrics = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials/{trial['id']}/metrics", headers=headers).json()
        assert [p["step"] for p in metrics["train"]] == list(range(1, 151))
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    workers = {w["id"]: w["state"] for w in httpx.get(f"{base_url}/v1/admin/workers", headers=admin).json()["data"]}
    assert workers["e2e-kill-a"] == "lost" and workers["e2e-kill-b"] == "alive"


@pytest.mark.slow
def test_smollm2_trains_on_a_small_chat_dataset(services: tuple[Cluster, str], tmp_path: Path) -> None:
    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-smol")
    headers = create_tenant_key(base_url, ADMIN_TOKEN, "team-smol")
    rows = [{"messages": [{"role": "system", "content": "You answer with one word."},
                          {"role": "user", "content": f"What colour is item {i}?"},
                          {"role": "assistant", "content": ["red", "green", "blue"][i % 3]}]}
            for i in range(12)]
    file_id = upload(base_url, headers, "\n".join(json.dumps(r) for r in rows).encode())
    task_id = submit(base_url, headers, {
        "base_model": "smollm2-135m-instruct", "training_file": file_id, "validation_split": 0.25,
        "search_space": {"learning_rate": [1e-4, 1e-3], "lora_rank": [4], "batch_size": [2]},
        "max_steps": 3, "max_seq_len": 64, "eval_interval": 3,
    })["id"]
    events = follow_events(base_url, headers, task_id, timeout_s=600)
    assert events[-1]["data"]["state"] == "succeeded", [e["event"] for e in events]
    adapter = download_adapter(base_url, headers, f"/v1/tasks/{task_id}/adapter", tmp_path / "adapter")
    assert_adapter_changes_output(adapter, "smollm2-135m-instruct", MODEL_CACHE)
