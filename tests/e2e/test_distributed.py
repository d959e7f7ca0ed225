"""The distributed mode end to end: `loraplane api`, `loraplane scheduler` and `loraplane worker` as
separate processes against the real PostgreSQL, Redis (bus and Celery broker) and artifact directory."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from tests.engine.factories import assert_rel_close
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


def test_a_task_submitted_while_a_pack_trains_joins_its_free_slot(services: tuple[Cluster, str]) -> None:
    """One worker, busy with a long task of two trials in a pack with room for four: a short task that
    arrives meanwhile is back-filled into the running pack and finishes (reported at once) while the long
    one still trains."""
    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-backfill")
    headers = create_tenant_key(base_url, ADMIN_TOKEN, "team-backfill")
    file_id = upload(base_url, headers, arithmetic_rows())
    long_body = grid_task(file_id, max_steps=2000)
    long_body["search_space"]["lora_rank"] = [4]
    long_body["scheduling"] = {"max_trials_per_pack": 4}
    long_id = submit(base_url, headers, long_body)["id"]

    def trials(task_id: str) -> list[dict[str, Any]]:
        return list(httpx.get(f"{base_url}/v1/tasks/{task_id}/trials", headers=headers).json()["data"])

    wait_for(lambda: all(t["steps_done"] >= 3 for t in trials(long_id)), 120, "the long task to train")
    short_body = grid_task(file_id, max_steps=6)
    short_body["search_space"] = {"learning_rate": [1e-3], "lora_rank": [2], "batch_size": [4],
                                  "target_modules": [["q_proj", "v_proj"]]}
    short_id = submit(base_url, headers, short_body)["id"]
    events = follow_events(base_url, headers, short_id, timeout_s=120)
    assert events[-1]["data"]["state"] == "succeeded", events[-1]
    (running,) = [e["data"] for e in events if e["event"] == "trial.running"]
    assert running["data"]["backfill"] is True, running
    long_events = httpx.get(f"{base_url}/v1/tasks/{long_id}/events", headers=headers).json()["data"]
    long_packs = {e["data"]["pack_id"] for e in long_events if e["type"] == "trial.running"}
    assert long_packs == {running["data"]["pack_id"]}, (running, long_events)
    task = httpx.get(f"{base_url}/v1/tasks/{long_id}", headers=headers).json()
    assert task["state"] == "running" and task["trial_counts"]["running"] == 2, task  # still training
    r = httpx.post(f"{base_url}/v1/tasks/{long_id}/cancel", headers=headers, timeout=10)
    assert r.status_code == 200, r.text


def test_alto_rotates_trials_through_their_warm_up_and_stops_the_weakest(services: tuple[Cluster, str]) -> None:
    """Four trials, two slots: the first two pause at their warm-up boundary (checkpointed, slots freed) so
    the other two can warm up; the ranking then keeps two, which finish, and stops two as underperforming.
    (Divergence and overfitting are switched off here: their thresholds are unit-tested on exact curves.)"""
    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-alto")
    headers = create_tenant_key(base_url, ADMIN_TOKEN, "team-alto")
    file_id = upload(base_url, headers, arithmetic_rows())
    # Long enough that the scheduler (a round every 0.5 s) acts at the warm-up boundary (step 50) well before
    # the first trials could finish: the tiny model trains hundreds of steps a second.
    body = grid_task(file_id, max_steps=1000)
    body["eval_interval"] = 250
    body["scheduling"] = {"max_trials_per_pack": 2}
    body["early_exit"] = {"policy": "alto", "keep_ratio": 0.5, "tau_slope": 100.0, "tau_gap": 100.0}
    task_id = submit(base_url, headers, body)["id"]
    events = follow_events(base_url, headers, task_id, timeout_s=300)
    assert events[-1]["data"]["state"] == "succeeded", events[-1]
    kinds = [e["event"] for e in events]
    assert kinds.count("trial.waiting") >= 2, kinds  # the first two waited for the others' warm-up
    stopped = [e["data"] for e in events if e["event"] == "trial.stopped_early"]
    assert len(stopped) == 2 and all(d["data"]["reason"] == "underperforming" for d in stopped), stopped
    task = httpx.get(f"{base_url}/v1/tasks/{task_id}", headers=headers).json()
    assert task["trial_counts"]["completed"] == 2 and task["trial_counts"]["stopped_early"] == 2, task
    trials = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials", headers=headers).json()["data"]
    stopped_ids = {d["trial_id"] for d in stopped}
    assert task["best_trial"]["id"] not in stopped_ids
    assert all(t["steps_done"] < 1000 for t in trials if t["id"] in stopped_ids)


def test_killed_worker_and_scheduler_lose_nothing(services: tuple[Cluster, str]) -> None:
    c, base_url = services
    worker_a = c.start("worker-a", "worker", "--worker-id", "e2e-kill-a")
    headers = create_tenant_key(base_url, ADMIN_TOKEN, "team-crash")
    file_id = upload(base_url, headers, arithmetic_rows())
    body = grid_task(file_id, max_steps=400)
    body["eval_interval"] = 20  # the worker checkpoints at this interval too
    task_id = submit(base_url, headers, body)["id"]

    def checkpointed() -> bool:
        trials = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials", headers=headers).json()["data"]
        return all((t["checkpoint_step"] or 0) >= 20 for t in trials)

    wait_for(checkpointed, 180, "a checkpoint of every trial", interval_s=0.2)
    scheduler = next(p for p in c.procs if p.name == "scheduler")
    worker_a.kill()
    scheduler.kill()
    c.start("scheduler-2", "scheduler")
    c.start("worker-b", "worker", "--worker-id", "e2e-kill-b")

    events = follow_events(base_url, headers, task_id, timeout_s=400)
    assert events[-1]["data"]["state"] == "succeeded", [e["event"] for e in events]
    requeued = [e for e in events if e["event"] == "trial.requeued"]
    assert len(requeued) == 4 and all("e2e-kill-a" in e["data"]["message"] for e in requeued)
    assert all(e["data"]["data"]["resume_step"] >= 20 for e in requeued)  # resumed, not restarted
    trials = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials", headers=headers).json()["data"]
    assert all(t["state"] == "completed" and t["steps_done"] == 400 and t["attempts"] == 2 for t in trials)
    for trial in trials:  # one point per step: nothing lost, nothing stored twice around the resume
        metrics = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials/{trial['id']}/metrics", headers=headers).json()
        assert [p["step"] for p in metrics["train"]] == list(range(1, 401))
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    workers = {w["id"]: w["state"] for w in httpx.get(f"{base_url}/v1/admin/workers", headers=admin).json()["data"]}
    assert workers["e2e-kill-a"] == "lost" and workers["e2e-kill-b"] == "alive"


def test_trials_trained_alone_equal_trials_trained_packed(services: tuple[Cluster, str], tmp_path: Path) -> None:
    """`scheduling.max_trials_per_pack = 1` gives, trial by trial, the adapters of the packed run."""
    from safetensors.torch import load_file

    c, base_url = services
    c.start("worker-a", "worker", "--worker-id", "e2e-alone")
    headers = create_tenant_key(base_url, ADMIN_TOKEN, "team-alone")
    file_id = upload(base_url, headers, arithmetic_rows())
    body = grid_task(file_id)
    body["search_space"].update(lora_dropout=[0.1], batch_size=[2, 4], lora_rank=[2, 4])
    packed = submit(base_url, headers, body)["id"]
    alone = submit(base_url, headers, {**body, "scheduling": {"max_trials_per_pack": 1}})["id"]
    for task_id in (packed, alone):
        assert follow_events(base_url, headers, task_id, timeout_s=300)[-1]["data"]["state"] == "succeeded"

    def adapters(task_id: str) -> list[dict[str, Any]]:
        trials = httpx.get(f"{base_url}/v1/tasks/{task_id}/trials", headers=headers).json()["data"]
        out = []
        for t in trials:
            d = download_adapter(base_url, headers, f"/v1/tasks/{task_id}/trials/{t['id']}/adapter",
                                 tmp_path / task_id / t["id"])
            out.append(load_file(str(d / "adapter_model.safetensors")))
        return out

    def packs(task_id: str) -> set[str]:
        events = httpx.get(f"{base_url}/v1/tasks/{task_id}/events", headers=headers).json()["data"]
        return {e["data"]["pack_id"] for e in events if e["type"] == "trial.running"}

    n_trials = len(httpx.get(f"{base_url}/v1/tasks/{alone}/trials", headers=headers).json()["data"])
    # The planner may split the packed task over the cluster's workers (it halves each pack's step); some
    # pack still holds several trials, and alone means one pack per trial.
    assert n_trials == 8 and len(packs(packed)) < n_trials and len(packs(alone)) == n_trials
    for packed_tensors, alone_tensors in zip(adapters(packed), adapters(alone), strict=True):
        assert packed_tensors.keys() == alone_tensors.keys()
        for key, value in packed_tensors.items():
            assert_rel_close(value, alone_tensors[key])


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
