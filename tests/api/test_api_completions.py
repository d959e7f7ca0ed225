"""Sampling's API side (issue 35), without a worker: what a completion request runs under and every refusal before a
sampler is asked, in the one error shape. The whole path through a real worker's sampler:
tests/e2e/test_trained_adapters.py."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from api.services.completions import open_requests
from common.bus import get_bus, sampling_reply_stream, sampling_stream
from common.db import session_scope
from common.messages import parse_sample_request
from common.settings import get_settings
from common.states import WORKER_ALIVE
from common.tables import Worker, utcnow
from tests.factories import ADMIN, TenantKey, make_task, make_tenant, store_adapter, trial_ids

PROMPT = {"prompt": "3 plus 4 is", "max_tokens": 4}


def _code(response: object) -> tuple[int, str]:
    r = response
    return r.status_code, r.json()["error"]["code"]  # type: ignore[attr-defined]


def _live_worker(models: list[str] | None) -> None:
    with session_scope() as session:
        session.merge(Worker(id="w-sampler", queue="q", device="cpu", state=WORKER_ALIVE, last_heartbeat=utcnow(),
                             models=models))


def test_what_a_completion_runs_under_and_its_refusals(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    url = f"/v1/tasks/{task['id']}/completions"
    assert _code(client.post(url, headers=tenant.headers, json=PROMPT)) == (409, "adapter_not_ready")
    trial_id = trial_ids(task["id"])[0]
    store_adapter(task["id"], trial_id)
    other = make_tenant(client, "other-sampler")
    assert _code(client.post(url, headers=other.headers, json=PROMPT)) == (404, "task_not_found")
    assert _code(client.post(url, headers=ADMIN, json=PROMPT)) == (403, "admin_read_only")
    chat = {"model": task["id"], "messages": [{"role": "user", "content": "hi"}]}
    assert _code(client.post("/v1/chat/completions", headers=other.headers, json=chat)) == (404, "model_not_found")
    assert _code(client.post("/v1/chat/completions", headers=tenant.headers,
                             json={**chat, "model": "no-such-model"})) == (404, "model_not_found")
    # No live worker loads the model: a 503 at once, with when to try again; nothing is sent.
    base_chat = {**chat, "model": "tiny-random-llama"}
    for path, body in ((url, PROMPT), (f"/v1/tasks/{task['id']}/trials/{trial_id}/completions", PROMPT),
                       ("/v1/chat/completions", chat), ("/v1/chat/completions", base_chat)):
        r = client.post(path, headers=tenant.headers, json=body)
        assert _code(r) == (503, "no_worker") and r.headers["Retry-After"] == "5", (path, r.text)
    _live_worker(models=["some-other-model"])
    assert _code(client.post(url, headers=tenant.headers, json=PROMPT)) == (503, "no_worker")


def test_a_request_no_sampler_answers_times_out_and_its_request_says_what_to_sample(
    client: TestClient, tenant: TenantKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = make_task(client, tenant)
    trial_id = trial_ids(task["id"])[2]
    store_adapter(task["id"], trial_id)
    _live_worker(models=None)  # a worker that does not say which models it loads: taken as every one
    monkeypatch.setattr(get_settings(), "sampling_timeout_s", 1.0)
    bus = get_bus()
    stream = sampling_stream(task["base_model"])
    after = bus.tail_id(stream)
    r = client.post(f"/v1/tasks/{task['id']}/trials/{trial_id}/completions", headers=tenant.headers,
                    json={"messages": [{"role": "user", "content": "2 plus 2?"}], "temperature": 0, "stop": "\n",
                          "seed": 11})
    assert _code(r) == (503, "sampling_timeout"), r.text
    sent = [parse_sample_request(body, on_drop=lambda reason: None) for _, body in bus.read_after(stream, after, 10, 0)]
    request = sent[-1]
    assert request is not None and request.trial_id == trial_id and request.tenant_id == tenant.id
    assert request.adapter_key and request.messages == [{"role": "user", "content": "2 plus 2?"}]
    assert (request.temperature, request.stop, request.seed, request.max_tokens) == (0.0, ["\n"], 11, 256)
    assert request.deadline - request.sent_at == pytest.approx(1.0)
    assert bus.read_after(sampling_reply_stream(request.request_id), "0", 10, 0) == []


def test_a_tenants_open_requests_are_capped_and_one_never_closed_stops_counting_at_its_deadline(
    client: TestClient, tenant: TenantKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = make_task(client, tenant)
    store_adapter(task["id"], trial_ids(task["id"])[0])
    _live_worker(models=None)
    monkeypatch.setattr(get_settings(), "sampling_max_inflight", 1)
    monkeypatch.setattr(get_settings(), "sampling_timeout_s", 0.5)
    url = f"/v1/tasks/{task['id']}/completions"
    open_requests.open(tenant.id, "cmpl-open", time.time() + 60)  # a stream still open
    try:
        r = client.post(url, headers=tenant.headers, json=PROMPT)
        assert _code(r) == (429, "too_many_requests") and r.headers["Retry-After"] == "1", r.text
        open_requests.open(tenant.id, "cmpl-open", time.time() - 1)  # never closed, its deadline passed
        assert _code(client.post(url, headers=tenant.headers, json=PROMPT)) == (503, "sampling_timeout")
    finally:
        open_requests.close(tenant.id, "cmpl-open")
    assert open_requests.count(tenant.id, time.time()) == 0  # the timed-out request closed itself

