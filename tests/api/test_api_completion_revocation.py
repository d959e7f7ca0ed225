"""A sampling request in flight is cut off within 2 s of its API key being revoked or its tenant deleted, as an open
event stream is (tests/api/test_api_stream_revocation.py): a request still waiting for its answer answers 401
`api_key_revoked` in the one error shape, and a streamed answer already begun ends with an `event: error` block,
also while the sampler keeps writing pieces. Another tenant's request in flight gets its answer.

Through the real app served by uvicorn in a thread, over real HTTP, with the real database and Redis bus. No worker
runs: a worker row says one is alive, and the test writes the sampler's side of the bus itself (the requests read off
the model's sampling stream, the answer's pieces written on each request's reply stream), as worker/sampler.py
does."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from common.bus import get_bus, sampling_reply_stream, sampling_stream
from common.db import session_scope
from common.messages import SampleReply, SampleRequest, parse_sample_request
from common.states import WORKER_ALIVE
from common.tables import Worker, utcnow
from tests.api.test_api_stream_revocation import (
    GENEROUS_S,
    PROMISE_S,
    Stream,
    delete_tenant,
    read_in_background,
    revoke_key,
)
from tests.e2e.procs import app_in_thread
from tests.factories import TenantKey, make_task, make_tenant, store_adapter, trial_ids

IN_FLIGHT = 10  # as many as the probe had open when it deleted the tenant
REVOKED = {"error": {"type": "authentication_error", "code": "api_key_revoked",
                     "message": "The API key this request was sent with was revoked, or its tenant deleted.",
                     "param": None}}


@pytest.fixture(scope="module")
def server(database: str) -> Iterator[str]:
    with app_in_thread() as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def http(server: str, clean_db: None) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=30) as c:
        yield c


def sampling_tenant(http: httpx.Client) -> tuple[TenantKey, str, str]:
    """A tenant, the completions URL of its task's trial that has an adapter, and the task's base model."""
    tenant = make_tenant(http)  # type: ignore[arg-type]
    task = make_task(http, tenant)  # type: ignore[arg-type]
    trial_id = trial_ids(task["id"])[0]
    store_adapter(task["id"], trial_id)
    return tenant, f"/v1/tasks/{task['id']}/trials/{trial_id}/completions", task["base_model"]


def live_worker() -> None:
    """A live worker that loads every model (its heartbeat fresh): the API sends requests to the samplers."""
    with session_scope() as session:
        session.merge(Worker(id="w-sampler", queue="q", device="cpu", state=WORKER_ALIVE, last_heartbeat=utcnow(),
                             models=None))


class Sampler:
    """The sampler's side of the bus: the requests sent on the model's stream since it was made, and their answers."""

    def __init__(self, model: str) -> None:
        self.bus, self.stream = get_bus(), sampling_stream(model)
        self.after = self.bus.tail_id(self.stream)
        self.requests: list[SampleRequest] = []

    def wait_for(self, n: int) -> list[SampleRequest]:
        """The first ``n`` requests sent, once they all were."""
        deadline = time.monotonic() + GENEROUS_S
        while len(self.requests) < n:
            assert time.monotonic() < deadline, f"{len(self.requests)} of {n} requests sent"
            for message_id, body in self.bus.read_after(self.stream, self.after, 100, 0):
                self.after = message_id
                request = parse_sample_request(body, on_drop=lambda reason: None)
                if request is not None:
                    self.requests.append(request)
            time.sleep(0.02)
        return self.requests[:n]

    def piece(self, request: SampleRequest, text: str) -> None:
        self.bus.publish(sampling_reply_stream(request.request_id),
                         SampleReply(request_id=request.request_id, text=text).to_dict())

    def answer(self, request: SampleRequest, text: str = " 7") -> None:
        self.bus.publish(sampling_reply_stream(request.request_id), SampleReply(
            request_id=request.request_id, text=text, done=True, finish_reason="stop", prompt_tokens=4,
            completion_tokens=1).to_dict())


def stream_completion(base: str, headers: dict[str, str], url: str) -> Stream:
    return read_in_background("POST", f"{base}{url}", headers, {"prompt": "3 plus 4 is", "stream": True})


def post_completion(http: httpx.Client, url: str, tenant: TenantKey) -> tuple[httpx.Response, float]:
    r = http.post(url, headers=tenant.headers, json={"prompt": "3 plus 4 is", "max_tokens": 4},
                  timeout=httpx.Timeout(30, read=GENEROUS_S))
    return r, time.monotonic()


@pytest.mark.parametrize("revoke", [revoke_key, delete_tenant], ids=["key-revoked", "tenant-deleted"])
def test_completions_waiting_for_the_sampler_answer_401_within_2s(
    http: httpx.Client, revoke: Callable[[httpx.Client, TenantKey], None]
) -> None:
    tenant, url, model = sampling_tenant(http)
    bystander, bystander_url, _ = sampling_tenant(http)
    live_worker()
    sampler = Sampler(model)
    with ThreadPoolExecutor(max_workers=IN_FLIGHT + 1) as pool:
        mine: list[Future[tuple[httpx.Response, float]]] = [
            pool.submit(post_completion, http, url, tenant) for _ in range(IN_FLIGHT)]
        theirs = pool.submit(post_completion, http, bystander_url, bystander)
        requests = sampler.wait_for(IN_FLIGHT + 1)  # all sent to the samplers: in flight, none answered
        assert not any(f.done() for f in (*mine, theirs))

        revoke(http, tenant)
        answered_at = time.monotonic()
        took = []
        for future in mine:
            r, ended_at = future.result(timeout=GENEROUS_S)
            assert (r.status_code, r.json()) == (401, REVOKED), r.text
            assert r.headers["WWW-Authenticate"] == "Bearer"
            took.append(ended_at - answered_at)
        assert max(took) < PROMISE_S, f"the last request ended {max(took):.2f} s after the revocation"
        print(f"{revoke.__name__}: {IN_FLIGHT} requests in flight cut off within {max(took):.3f} s")

        # The other tenant's request is still in flight, and answered when its sampler answers.
        assert not theirs.done()
        sampler.answer(next(q for q in requests if q.tenant_id == bystander.id))
        r, _ = theirs.result(timeout=GENEROUS_S)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " 7", r.text
    assert http.post(url, headers=tenant.headers, json={"prompt": "hi"}).status_code == 401  # and new ones


@pytest.mark.parametrize("revoke", [revoke_key, delete_tenant], ids=["key-revoked", "tenant-deleted"])
def test_a_streamed_completion_ends_with_an_error_event_within_2s_while_pieces_keep_coming(
    http: httpx.Client, server: str, revoke: Callable[[httpx.Client, TenantKey], None]
) -> None:
    tenant, url, model = sampling_tenant(http)
    live_worker()
    sampler = Sampler(model)
    streamed = stream_completion(server, tenant.headers, url)
    (request,) = sampler.wait_for(1)
    sampler.piece(request, "Seven")
    assert streamed.started.wait(GENEROUS_S), "the stream sent nothing"
    assert streamed.status == 200 and json.loads(streamed.blocks[0]["data"])["choices"][0]["text"] == "Seven"

    stop = threading.Event()

    def keep_sampling() -> None:  # a long answer still being decoded: a piece every 20 ms
        while not stop.is_set():
            sampler.piece(request, ".")
            stop.wait(0.02)

    writer = threading.Thread(target=keep_sampling, daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + GENEROUS_S
        while len(streamed.blocks) < 3:  # pieces flow to the client
            assert time.monotonic() < deadline and not streamed.ended.is_set(), streamed.blocks
            time.sleep(0.01)
        revoke(http, tenant)
        answered_at = time.monotonic()
        assert streamed.ended.wait(GENEROUS_S), "the stream is still open"
    finally:
        stop.set()
        writer.join(timeout=GENEROUS_S)
        sampler.answer(request)  # ends a stream the cut-off missed (the feature broken)
    took = streamed.ended_at - answered_at
    last = streamed.blocks[-1]
    assert last.get("event") == "error" and json.loads(last["data"]) == REVOKED, streamed.blocks[-3:]
    assert all("event" not in b and "choices" in json.loads(b["data"]) for b in streamed.blocks[:-1])
    assert took < PROMISE_S, f"the stream ended {took:.2f} s after the revocation"
    print(f"{revoke.__name__}: the streamed completion ended {took:.3f} s after")
