"""Trials, their loss curves and their adapters."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import redis
from fastapi.testclient import TestClient

from common.artifacts import (
    export_claimed_key,
    export_failure_key,
    export_key,
    export_requested_key,
    get_artifact_store,
)
from common.celery import exports_queue
from common.db import session_scope
from common.export_builds import BuildClaim, BuildRequest
from common.settings import get_settings
from common.states import TASK_SUCCEEDED, TRIAL_COMPLETED, TRIAL_FAILED, WORKER_ALIVE
from common.tables import BaseModelEntry, MetricPoint, Task, Trial, Worker, new_id
from tests.factories import ADMIN, TenantKey, make_task, store_adapter, trial_ids, update_row


def test_list_and_get_trials(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    trials = client.get(f"/v1/tasks/{task['id']}/trials", headers=tenant.headers).json()
    assert trials["object"] == "list" and [t["index"] for t in trials["data"]] == [0, 1, 2, 3]
    first = trials["data"][0]
    assert set(first) == {
        "id", "object", "task_id", "index", "state", "hyperparameters", "total_steps", "steps_done", "best_val_loss",
        "best_step", "last_train_loss", "metric_score", "stop_reason", "error", "attempts", "checkpoint_step",
        "adapter_ready", "refit_of", "created_at", "started_at", "finished_at",
    }
    assert first["metric_score"] is None
    one = client.get(f"/v1/tasks/{task['id']}/trials/{first['id']}", headers=tenant.headers)
    assert one.status_code == 200 and one.json() == first
    update_row(Trial, first["id"], metric_score=0.75)
    assert client.get(f"/v1/tasks/{task['id']}/trials/{first['id']}", headers=tenant.headers).json()[
        "metric_score"] == 0.75


def test_trial_of_another_task_is_404(client: TestClient, tenant: TenantKey) -> None:
    a, b = make_task(client, tenant), make_task(client, tenant)
    trial_of_b = trial_ids(b["id"])[0]
    r = client.get(f"/v1/tasks/{a['id']}/trials/{trial_of_b}", headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "trial_not_found")


def test_trial_metrics_split_by_train_and_val_within_a_step_window(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]
    with session_scope() as session:
        for step in range(1, 7):
            session.add(MetricPoint(trial_id=trial_id, step=step, split="train", loss=3.0 - step * 0.1))
        for step in (2, 4, 6):
            session.add(MetricPoint(trial_id=trial_id, step=step, split="val", loss=3.5 - step * 0.1))
        session.add(MetricPoint(trial_id=trial_id, step=6, split="metric", loss=0.625))
    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/metrics"
    full = client.get(url, headers=tenant.headers).json()
    assert full["object"] == "trial.metrics" and full["trial_id"] == trial_id
    assert [p["step"] for p in full["train"]] == [1, 2, 3, 4, 5, 6]
    assert full["val"][0] == {"step": 2, "loss": 3.3}
    assert full["metric"] == [{"step": 6, "score": 0.625}]  # the generative metric's score, beside the losses
    window = client.get(f"{url}?step_from=2&step_to=4", headers=tenant.headers).json()
    assert [p["step"] for p in window["train"]] == [2, 3, 4]
    assert [p["step"] for p in window["val"]] == [2, 4]
    assert window["metric"] == []
    empty = client.get(f"/v1/tasks/{task['id']}/trials/{trial_ids(task['id'])[1]}/metrics", headers=tenant.headers)
    assert empty.json()["train"] == [] and empty.json()["val"] == [] and empty.json()["metric"] == []


def test_adapter_is_409_until_it_exists_then_downloads(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[2]
    task_url, trial_url = f"/v1/tasks/{task['id']}/adapter", f"/v1/tasks/{task['id']}/trials/{trial_id}/adapter"
    for url in (task_url, trial_url):
        r = client.get(url, headers=tenant.headers)
        assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready")

    trial_url_json = f"/v1/tasks/{task['id']}/trials/{trial_id}"
    assert client.get(trial_url_json, headers=tenant.headers).json()["adapter_ready"] is False
    payload = store_adapter(task["id"], trial_id, b"\x1f\x8b" + bytes(range(256)) * 10)
    assert client.get(trial_url_json, headers=tenant.headers).json()["adapter_ready"] is True
    for url in (task_url, trial_url):
        r = client.get(url, headers=tenant.headers)
        assert r.status_code == 200
        assert r.content == payload
        assert r.headers["content-type"] == "application/gzip"
        assert r.headers["content-disposition"] == f'attachment; filename="{task["id"]}-{trial_id}-adapter.tar.gz"'


def test_adapter_key_without_stored_archive_is_409(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]
    update_row(Trial, trial_id, adapter_key="adapters/nowhere/none.tar.gz")
    r = client.get(f"/v1/tasks/{task['id']}/trials/{trial_id}/adapter", headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready")


def test_a_refit_task_keeps_its_row_counts_and_serves_its_refit_adapter_apart(client: TestClient,
                                                                                tenant: TenantKey) -> None:
    """Issue 33: `"refit": true` is stored with the rows each split has, the task names its refit trial once the
    scheduler made it, and GET .../adapter?refit=true serves that trial's adapter: 409 adapter_not_ready until it
    is there, no_refit for a task that did not ask for one or whose refit failed."""
    plain = make_task(client, tenant)
    task = make_task(client, tenant, refit=True)
    assert (task["refit"], task["refit_trial_id"], plain["refit"]) == (True, None, False)
    with session_scope() as session:
        spec = session.get_one(Task, task["id"]).parsed_spec
    assert spec.refit and spec.training_rows is not None and spec.validation_rows is not None
    assert spec.training_rows + spec.validation_rows == 10  # the factory's file
    refit_url = f"/v1/tasks/{task['id']}/adapter?refit=true"
    r = client.get(f"/v1/tasks/{plain['id']}/adapter?refit=true", headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "no_refit")
    r = client.get(refit_url, headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready")

    winner = trial_ids(task["id"])[1]
    best = store_adapter(task["id"], winner, b"\x1f\x8b best")
    refit_id = new_id("trial")
    with session_scope() as session:
        row = session.get_one(Task, task["id"])
        session.add(Trial(id=refit_id, task_id=row.id, tenant_id=row.tenant_id, index=4, state="pending",
                          hyperparameters={}, total_steps=5, refit_of=winner))
        row.refit_trial_id = refit_id
    shown = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert shown["refit_trial_id"] == refit_id and shown["best_trial"]["id"] == winner
    trial = client.get(f"/v1/tasks/{task['id']}/trials/{refit_id}", headers=tenant.headers).json()
    assert trial["refit_of"] == winner
    r = client.get(refit_url, headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready")
    assert client.get(f"/v1/tasks/{task['id']}/adapter", headers=tenant.headers).content == best

    refitted = store_adapter(task["id"], refit_id, b"\x1f\x8b refit")
    update_row(Task, task["id"], best_trial_id=winner, state=TASK_SUCCEEDED)  # store_adapter pointed it at the refit
    update_row(Trial, refit_id, state=TRIAL_COMPLETED)
    assert client.get(refit_url, headers=tenant.headers).content == refitted
    assert client.get(f"/v1/tasks/{task['id']}/adapter", headers=tenant.headers).content == best
    update_row(Trial, refit_id, state=TRIAL_FAILED, adapter_key=None)
    r = client.get(refit_url, headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "no_refit")
    assert "best trial's adapter" in r.json()["error"]["message"]


def test_a_merged_model_is_asked_of_the_workers_once_reports_its_failure_once_then_downloads(
    client: TestClient, tenant: TenantKey
) -> None:
    """Issue 35: ?format=merged is 409 adapter_not_ready without an adapter; then 202 while a worker builds it,
    asked of the workers on the first request only; a failed build is one 409 export_failed with its reason, and the
    next request asks again; once stored, the archive downloads."""
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[1]
    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/adapter?format=merged"
    r = client.get(url, headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready")
    store_adapter(task["id"], trial_id, b"\x1f\x8b" + bytes(16))
    store = get_artifact_store()
    asked = export_requested_key(task["id"], trial_id, "merged")

    r = client.get(url, headers=tenant.headers)
    assert r.status_code == 202 and r.json()["status"] == "building" and r.headers["retry-after"] == "5"
    first_ask = store.get_bytes(asked)
    assert client.get(url, headers=tenant.headers).status_code == 202 and store.get_bytes(asked) == first_ask

    failure = json.dumps({"error": "OSError: disk full"}).encode()
    store.put_bytes(export_failure_key(task["id"], trial_id, "merged"), failure)
    r = client.get(url, headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "export_failed") and "disk full" in r.text
    assert client.get(url, headers=tenant.headers).status_code == 202 and store.get_bytes(asked) != first_ask

    store.put_bytes(export_key(task["id"], trial_id, "merged"), b"\x1f\x8b merged")
    r = client.get(url, headers=tenant.headers)
    assert r.status_code == 200 and r.content == b"\x1f\x8b merged"
    assert r.headers["content-disposition"] == f'attachment; filename="{task["id"]}-{trial_id}-merged.tar.gz"'
    bad = client.get(f"/v1/tasks/{task['id']}/adapter?format=onnx", headers=tenant.headers)
    assert bad.status_code == 422 and "'merged' or 'gguf'" in bad.json()["error"]["message"], bad.text


def test_a_gguf_adapter_is_built_on_request_for_architectures_that_have_one(client: TestClient,
                                                                            tenant: TenantKey) -> None:
    """?format=gguf goes the merged model's way (202, then the file); a base whose architecture llama.cpp's LoRA
    names do not cover is a 422 naming the formats it has."""
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]
    store_adapter(task["id"], trial_id, b"\x1f\x8b" + bytes(16))
    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/adapter?format=gguf"
    r = client.get(url, headers=tenant.headers)
    assert r.status_code == 202 and "GGUF" in r.json()["message"], r.text
    assert get_artifact_store().exists(export_requested_key(task["id"], trial_id, "gguf"))
    get_artifact_store().put_bytes(export_key(task["id"], trial_id, "gguf"), b"GGUF...")
    r = client.get(f"/v1/tasks/{task['id']}/adapter?format=gguf", headers=tenant.headers)
    assert r.status_code == 200 and r.content == b"GGUF..." and r.headers["content-type"] == "application/octet-stream"
    assert r.headers["content-disposition"] == f'attachment; filename="{task["id"]}-{trial_id}-adapter.gguf"'
    update_row(BaseModelEntry, task["base_model"], architecture="phi3")
    r = client.get(url, headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (422, "unsupported_format",
                                                                                      "format"), r.text
    assert r.json()["error"]["formats"] == ["peft", "merged"] and "phi3" in r.json()["error"]["message"]


def queued_builds() -> int:
    """The build messages waiting on the exports queue (the suite's broker is its Redis: a kombu list per queue)."""
    return int(redis.Redis.from_url(get_settings().resolved_broker_url).llen(exports_queue(get_settings())))


def test_the_admin_token_reads_an_export_but_never_starts_a_build(client: TestClient, tenant: TenantKey) -> None:
    """Issue 52: the admin token only reads. An unbuilt export is a 409 adapter_not_ready for it, with nothing sent to
    the workers and nothing written to the store; a failed build's reason is shown and kept for the tenant; a built
    one is served."""
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]
    store_adapter(task["id"], trial_id, b"\x1f\x8b" + bytes(16))
    store = get_artifact_store()
    asked = export_requested_key(task["id"], trial_id, "merged")
    before = queued_builds()
    for url in (f"/v1/tasks/{task['id']}/adapter?format=merged",
                f"/v1/tasks/{task['id']}/trials/{trial_id}/adapter?format=merged"):
        r = client.get(url, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready"), r.text
        assert "only reads" in r.json()["error"]["message"]
    assert not store.exists(asked) and queued_builds() == before  # nothing asked of the workers
    assert store.keys(f"exports/{task['id']}/{trial_id}") == []

    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/adapter?format=merged"
    assert client.get(url, headers=tenant.headers).status_code == 202 and queued_builds() == before + 1
    r = client.get(url, headers=ADMIN)  # the tenant's build is under way: still only a read
    assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_not_ready") and "under way" in r.text
    failure = export_failure_key(task["id"], trial_id, "merged")
    store.put_bytes(failure, json.dumps({"error": "OSError: disk full"}).encode())
    r = client.get(url, headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "export_failed") and "disk full" in r.text
    assert store.exists(failure) and store.exists(asked)  # kept: the tenant is told too
    assert client.get(url, headers=tenant.headers).json()["error"]["code"] == "export_failed"
    store.put_bytes(export_key(task["id"], trial_id, "merged"), b"\x1f\x8b merged")
    r = client.get(url, headers=ADMIN)
    assert r.status_code == 200 and r.content == b"\x1f\x8b merged"
    assert queued_builds() == before + 1


def test_a_build_whose_worker_is_gone_is_sent_again_and_the_202_says_why(client: TestClient,
                                                                         tenant: TenantKey) -> None:
    """Issue 52: a build claimed by a worker process (its claim, as worker/exports.py writes it) is sent again once
    another process beats under that worker's id, or once its beats stop while others' arrive; while it beats, or
    while a claim is of an earlier send, it is not."""
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]
    store_adapter(task["id"], trial_id, b"\x1f\x8b" + bytes(16))
    store = get_artifact_store()
    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/adapter?format=merged"
    asked, claimed = (export_requested_key(task["id"], trial_id, "merged"),
                      export_claimed_key(task["id"], trial_id, "merged"))
    now = datetime.now(UTC)
    with session_scope() as session:
        for worker_id in ("w-build", "w-other"):
            session.add(Worker(id=worker_id, queue="q", device="cpu", state=WORKER_ALIVE, last_heartbeat=now,
                               incarnation="inc-1", incarnation_started_at=now - timedelta(minutes=10)))
    before = queued_builds()
    first = client.get(url, headers=tenant.headers)
    assert first.status_code == 202 and first.json()["resent"] is None, first.text
    request = BuildRequest.from_json(store.get_bytes(asked))
    assert request is not None and request.request_id
    timeout_s = get_settings().worker_timeout_s

    def claim(request_id: str, age_s: float) -> None:
        started = (now - timedelta(minutes=10)).timestamp()
        store.put_bytes(claimed, BuildClaim(request_id=request_id, worker_id="w-build", incarnation="inc-1",
                                            started_at=started, at=time.time() - age_s).to_json())

    claim(request.request_id, timeout_s + 5)
    assert client.get(url, headers=tenant.headers).json()["resent"] is None  # its worker beats: being built
    update_row(Worker, "w-build", last_heartbeat=now - timedelta(seconds=timeout_s + 5))
    update_row(Worker, "w-other", last_heartbeat=datetime.now(UTC))
    silent = client.get(url, headers=tenant.headers)
    assert silent.status_code == 202 and silent.json()["resent"] == "worker_silent", silent.text
    assert silent.json()["lost_worker"] == "w-build" and "stopped answering" in silent.json()["message"]
    again = BuildRequest.from_json(store.get_bytes(asked))
    assert again is not None and again.request_id != request.request_id and queued_builds() == before + 2
    # The old claim names the send given up on: nothing more is sent, and the 202 keeps saying why it was resent.
    assert client.get(url, headers=tenant.headers).json()["resent"] == "worker_silent"
    assert queued_builds() == before + 2

    claim(again.request_id, 1)  # taken again by w-build's process, which beats again ...
    update_row(Worker, "w-build", last_heartbeat=datetime.now(UTC))
    assert client.get(url, headers=tenant.headers).json()["resent"] == "worker_silent"
    assert queued_builds() == before + 2
    # ... and is killed: `up` (or systemd) starts it again under its id, and the new process beats.
    update_row(Worker, "w-build", incarnation="inc-2", incarnation_started_at=datetime.now(UTC))
    restarted = client.get(url, headers=tenant.headers)
    assert restarted.json()["resent"] == "worker_restarted" and queued_builds() == before + 3, restarted.text
    assert "restarted" in restarted.json()["message"]
