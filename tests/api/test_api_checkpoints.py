"""A trial's kept checkpoints through the API: listing with their kinds, download, isolation, sampling one, their
bytes in the tenant's storage quota, and deleting one. The checkpoints a real pack keeps and reports:
tests/worker/test_runner.py and tests/e2e/test_trained_adapters.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from common.artifacts import get_artifact_store, saved_checkpoint_key
from common.bus import get_bus, sampling_stream
from common.db import get_autocommit_engine, get_engine, session_scope
from common.messages import parse_sample_request
from common.settings import get_settings
from common.states import WORKER_ALIVE
from common.tables import Checkpoint, Tenant, Trial, Worker, utcnow
from tests.factories import ADMIN, TenantKey, make_task, make_tenant, trial_ids, update_row, upload


def _keep(task_id: str, trial_id: str, tenant_id: str, step: int, loss: float | None, payload: bytes) -> None:
    """A checkpoint where the worker puts one, recorded as the scheduler records its report (4 steps an epoch)."""
    key = saved_checkpoint_key(task_id, trial_id, step)
    get_artifact_store().put_bytes(key, payload)
    with session_scope() as session:
        session.add(Checkpoint(trial_id=trial_id, task_id=task_id, tenant_id=tenant_id, step=step, epoch=step / 4,
                               epoch_end=step % 4 == 0, val_loss=loss, adapter_key=key, size_bytes=len(payload)))


def test_a_trials_checkpoints_are_listed_downloaded_and_its_own(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[1]
    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/checkpoints"
    assert client.get(url, headers=tenant.headers).json()["data"] == []
    for step, loss in ((4, 1.5), (6, 1.2), (8, 1.3), (10, None)):
        _keep(task["id"], trial_id, tenant.id, step, loss, f"archive at {step}".encode())
    update_row(Trial, trial_id, metric_score=0.75, finished_at=utcnow())
    listed = client.get(url, headers=tenant.headers).json()["data"]
    assert [(c["step"], c["epoch"], c["kinds"], c["val_loss"]) for c in listed] == [
        (4, 1.0, ["epoch"], 1.5), (6, 1.5, ["best"], 1.2), (8, 2.0, ["epoch"], 1.3), (10, 2.5, ["last"], None)]
    assert [c["metric_score"] for c in listed] == [None, 0.75, None, None]  # only the best adapter is scored
    assert listed[1]["model"] == f"{task['id']}:{trial_id}:6" and listed[1]["size_bytes"] == len(b"archive at 6")
    one = client.get(f"{url}/6", headers=tenant.headers)
    assert one.status_code == 200 and one.json() == listed[1]
    r = client.get(f"{url}/6/adapter", headers=tenant.headers)
    assert r.status_code == 200 and r.content == b"archive at 6"
    assert f'filename="{task["id"]}-{trial_id}-step-6.tar"' in r.headers["content-disposition"]
    assert r.headers["content-type"] == "application/x-tar"
    assert client.get(f"{url}/6/adapter", headers=ADMIN).status_code == 200  # the operator reads any tenant's

    def code(path: str, headers: dict[str, str]) -> tuple[int, str]:
        r = client.get(path, headers=headers)
        return r.status_code, r.json()["error"]["code"]

    assert code(f"{url}/7", tenant.headers) == (404, "checkpoint_not_found")
    assert code(f"{url}/7/adapter", tenant.headers) == (404, "checkpoint_not_found")
    other = make_tenant(client, "other-checkpoints")
    assert code(url, other.headers) == (404, "task_not_found")
    assert code(f"{url}/6/adapter", other.headers) == (404, "task_not_found")
    assert code(f"{url}/-1", tenant.headers)[0] == 422
    get_artifact_store().delete(saved_checkpoint_key(task["id"], trial_id, 8))  # dropped by its worker just now
    assert code(f"{url}/8/adapter", tenant.headers) == (409, "checkpoint_gone")


def test_checkpoints_count_in_the_tenants_stored_bytes(client: TestClient) -> None:
    tenant = make_tenant(client, "quota-checkpoints")
    task = make_task(client, tenant)
    used = client.get("/v1/usage", headers=tenant.headers).json()
    assert used["checkpoint_bytes"] == 0
    _keep(task["id"], trial_ids(task["id"])[0], tenant.id, 4, 1.0, b"x" * 5000)
    usage = client.get("/v1/usage", headers=tenant.headers).json()
    assert (usage["storage_bytes"], usage["checkpoint_bytes"]) == (used["storage_bytes"] + 5000, 5000)
    update_row(Tenant, tenant.id, max_storage_bytes=used["storage_bytes"] + 5000 + 100)
    r = client.post("/v1/files", headers=tenant.headers, files={"file": ("more.jsonl", b'{"prompt": "a", '
                                                                         b'"completion": "b"}\n' * 20)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded", r.text
    assert "checkpoints" in r.json()["error"]["message"]
    update_row(Tenant, tenant.id, max_storage_bytes=10**9)
    assert upload(client, tenant)["id"]


def test_a_deleted_checkpoint_is_gone_and_frees_its_bytes(client: TestClient) -> None:
    """The tenant deletes a checkpoint: its row and archive go, its bytes leave the quota, the kinds of those left
    are theirs again; another tenant, the operator and a second delete cannot."""
    tenant = make_tenant(client, "delete-checkpoints")
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]
    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/checkpoints"
    _keep(task["id"], trial_id, tenant.id, 4, 1.0, b"x" * 3000)
    _keep(task["id"], trial_id, tenant.id, 8, 1.5, b"y" * 2000)
    assert client.get("/v1/usage", headers=tenant.headers).json()["checkpoint_bytes"] == 5000
    other = make_tenant(client, "other-delete-checkpoints")
    assert client.delete(f"{url}/4", headers=other.headers).json()["error"]["code"] == "task_not_found"
    assert client.delete(f"{url}/4", headers=ADMIN).status_code in (401, 403)  # the operator reads, never deletes

    r = client.delete(f"{url}/4", headers=tenant.headers)
    assert r.status_code == 200 and r.json() == {"object": "checkpoint", "trial_id": trial_id, "step": 4,
                                                 "deleted": True}
    assert not get_artifact_store().exists(saved_checkpoint_key(task["id"], trial_id, 4))
    assert get_artifact_store().exists(saved_checkpoint_key(task["id"], trial_id, 8))
    assert [(c["step"], c["kinds"]) for c in client.get(url, headers=tenant.headers).json()["data"]] == [
        (8, ["best", "last", "epoch"])]
    assert client.get("/v1/usage", headers=tenant.headers).json()["checkpoint_bytes"] == 2000
    again = client.delete(f"{url}/4", headers=tenant.headers)
    assert (again.status_code, again.json()["error"]["code"]) == (404, "checkpoint_not_found")


def test_sampling_a_checkpoint_sends_its_adapter(client: TestClient, tenant: TenantKey,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]  # still training: no adapter of its own yet
    _keep(task["id"], trial_id, tenant.id, 4, 1.0, b"archive")
    with session_scope() as session:
        session.merge(Worker(id="w-sampler", queue="q", device="cpu", state=WORKER_ALIVE, last_heartbeat=utcnow()))
    monkeypatch.setattr(get_settings(), "sampling_timeout_s", 0.3)
    bus = get_bus()
    stream = sampling_stream(task["base_model"])
    after = bus.tail_id(stream)
    base = f"/v1/tasks/{task['id']}/trials/{trial_id}/completions"
    prompt = {"prompt": "hi", "max_tokens": 2}
    assert client.post(base, headers=tenant.headers, json=prompt).json()["error"]["code"] == "adapter_not_ready"
    r = client.post(base, headers=tenant.headers, json={**prompt, "checkpoint": 5})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "checkpoint_not_found")
    r = client.post(base, headers=tenant.headers, json={**prompt, "checkpoint": 4})
    assert r.json()["error"]["code"] == "sampling_timeout"  # sent; no sampler runs here
    chat = {"model": f"{task['id']}:{trial_id}:4", "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", headers=tenant.headers, json=chat).json()["error"]["code"] == \
        "sampling_timeout"
    for model in (f"{task['id']}:{trial_id}:5", f"{task['id']}:{trial_id}:x4"):
        r = client.post("/v1/chat/completions", headers=tenant.headers, json={**chat, "model": model})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found"), model
    sent = [parse_sample_request(body, on_drop=lambda reason: None) for _, body in bus.read_after(stream, after, 10, 0)]
    assert [(m.trial_id, m.adapter_key) for m in sent if m is not None] == [
        (trial_id, saved_checkpoint_key(task["id"], trial_id, 4))] * 2


def test_of_concurrent_deletes_of_a_checkpoint_exactly_one_answers_200(client: TestClient) -> None:
    """Issue 52: three DELETEs of one checkpoint at once: one 200, two 404s. The race is made certain, not left to
    the thread scheduler: the test holds the checkpoint's row lock while the three requests read it and reach their
    DELETE (the database shows all three waiting for the lock), then lets them go."""
    tenant = make_tenant(client, "race-checkpoints")
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[0]
    url = f"/v1/tasks/{task['id']}/trials/{trial_id}/checkpoints/4"
    _keep(task["id"], trial_id, tenant.id, 4, 1.0, b"x" * 100)
    # The pool outside the lock: should the test fail while it holds the lock, the lock goes before the pool waits.
    with ThreadPoolExecutor(3) as pool, get_engine().connect() as holder:
        holder.execute(select(Checkpoint.id).where(Checkpoint.trial_id == trial_id).with_for_update())
        answers = [pool.submit(client.delete, url, headers=tenant.headers) for _ in range(3)]
        deadline = time.monotonic() + 60
        # Autocommit: a transaction would see one snapshot of pg_stat_activity for its whole length.
        with get_autocommit_engine().connect() as probe:
            while probe.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                     "AND wait_event_type = 'Lock'")).scalar_one() < 3:
                assert time.monotonic() < deadline, "the three DELETEs never all waited for the row lock"
                assert not any(a.done() for a in answers), [a.result().text for a in answers if a.done()]
                time.sleep(0.05)
        holder.rollback()  # the lock goes: the first DELETE removes the row, the others find it gone
        results = [a.result(timeout=60) for a in answers]
    assert sorted(r.status_code for r in results) == [200, 404, 404], [r.text for r in results]
    assert [r.json()["error"]["code"] for r in results if r.status_code == 404] == ["checkpoint_not_found"] * 2
    assert not get_artifact_store().exists(saved_checkpoint_key(task["id"], trial_id, 4))
