"""Webhooks end to end against a real receiver on 127.0.0.1: registration and its validation, the outbox written
with each event, the signed deliveries, retries with backoff, a sender that dies mid-way, tenant isolation."""

from __future__ import annotations

import json
import os
import ssl
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from common import states
from common.bus import SCHEDULER_STREAM, get_bus
from common.celery import get_celery, worker_queue
from common.db import session_scope
from common.events import record_event
from common.messages import REPORT_TYPES
from common.settings import get_settings
from common.tables import Pack, Task, WebhookDelivery, utcnow
from scheduler.service.daemon import SchedulerDaemon
from scheduler.service.webhooks import CLAIM_S, WebhookSender, next_delay, sign, verify
from tests.conftest import REDIS_URL
from tests.egress import ALLOW_SETTING, TableResolver, allowed_networks
from tests.factories import ADMIN, ADMIN_TOKEN, TenantKey, chat_rows, make_task, trial_ids

WORKER = "w-webhooks"


@dataclass
class Receiver:
    """A real HTTP endpoint: records every request and answers the next status of `statuses` (then 200)."""

    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    got: threading.Event = field(default_factory=threading.Event)


@contextmanager
def serve_receiver(tls: ssl.SSLContext | None = None) -> Iterator[Receiver]:
    """A receiver on 127.0.0.1 (https with `tls`, a server context: its certificate's names are the test's)."""
    box: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            rec = box[0]
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            rec.requests.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
            status = rec.statuses.pop(0) if rec.statuses else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            rec.got.set()

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    scheme = "http"
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    box.append(Receiver(url=f"{scheme}://127.0.0.1:{server.server_address[1]}/hook"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A receiver on loopback that the operator allows (LORAPLANE_WEBHOOK_ALLOWED_NETWORKS), as a deployment with
    an in-cluster receiver would: loopback is refused otherwise (tests/api/test_api_webhook_egress.py)."""
    with serve_receiver() as rec, allowed_networks("127.0.0.1"):
        yield rec


def register(client: TestClient, tenant: TenantKey, url: str, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/webhooks", headers=tenant.headers, json={"url": url, **fields})
    assert r.status_code == 201, r.text
    return dict(r.json())


def deliveries(client: TestClient, tenant: TenantKey, webhook_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/webhooks/{webhook_id}/deliveries", headers=tenant.headers)
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def assert_signed(request: dict[str, Any], secret: str) -> dict[str, Any]:
    h = request["headers"]
    assert verify(secret, h["X-Loraplane-Timestamp"], request["body"], h["X-Loraplane-Signature"])
    assert not verify("whsec_wrong", h["X-Loraplane-Timestamp"], request["body"], h["X-Loraplane-Signature"])
    body = json.loads(request["body"])
    assert h["X-Loraplane-Event"] == body["type"] and h["X-Loraplane-Delivery"].startswith("whd-")
    return dict(body)


def cancel(client: TestClient, tenant: TenantKey) -> str:
    task = make_task(client, tenant)
    assert client.post(f"/v1/tasks/{task['id']}/cancel", headers=tenant.headers).status_code == 200
    return str(task["id"])


# ---- pure parts ------------------------------------------------------------------------------------------------


def test_signature_and_backoff_schedule() -> None:
    # A receiver computes the same HMAC by hand: hex HMAC-SHA256 of "{timestamp}.{body}".
    import hashlib
    import hmac

    body = b'{"id":1}'
    expected = hmac.new(b"s3cret", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign("s3cret", 1700000000, body) == f"v1={expected}"
    assert verify("s3cret", "1700000000", body, f"v1={expected}", now=1700000100)
    assert not verify("s3cret", "1700000000", body + b" ", f"v1={expected}", now=1700000100)  # body changed
    assert not verify("s3cret", "1700000000", body, f"v1={expected}", now=1700009999)  # replayed later
    assert not verify("s3cret", "17e8", body, f"v1={expected}", now=1700000100)
    assert [next_delay(n, (10, 30, 120)) for n in (1, 2, 3, 4)] == [10, 30, 120, None]


# ---- the API ---------------------------------------------------------------------------------------------------


def test_register_shows_the_secret_once_and_lists_and_deletes(client: TestClient, tenant: TenantKey) -> None:
    created = register(client, tenant, "https://example.com/hooks", description="ops",
                       events=["task.failed", "task.succeeded", "task.failed"])
    assert created["secret"].startswith("whsec_") and len(created["secret"]) > 30
    assert created["events"] == ["task.succeeded", "task.failed"]  # deduplicated
    everything = register(client, tenant, "http://example.com/all")
    assert everything["events"] == ["task.succeeded", "task.failed", "task.cancelled", "trial.completed"]
    shown = client.get(f"/v1/webhooks/{created['id']}", headers=tenant.headers).json()
    assert "secret" not in shown and shown["url"] == "https://example.com/hooks" and shown["description"] == "ops"
    listed = client.get("/v1/webhooks", headers=tenant.headers).json()["data"]
    assert [w["id"] for w in listed] == [everything["id"], created["id"]]
    assert all("secret" not in w for w in listed) and created["secret"] not in json.dumps(listed)
    r = client.delete(f"/v1/webhooks/{created['id']}", headers=tenant.headers)
    assert r.status_code == 200 and r.json() == {"id": created["id"], "object": "webhook", "deleted": True}
    assert client.get(f"/v1/webhooks/{created['id']}", headers=tenant.headers).status_code == 404


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"url": "ftp://example.com/x"}, "url", "invalid_url"),
    ({"url": "example.com/hook"}, "url", "invalid_url"),
    ({"url": "http://"}, "url", "invalid_url"),
    ({"url": "http://example.com:99999/"}, "url", "invalid_url"),
    ({"url": "http://exa mple.com/"}, "url", "invalid_url"),
    ({"url": "javascript:alert(1)"}, "url", "invalid_url"),
    # Issue 52: a host that URL parsers read differently (`\` or a percent-escape before it).
    ({"url": "https://evil.example\\@example.com/hook"}, "url", "invalid_url"),
    ({"url": "https://evil.example%2f@example.com/hook"}, "url", "invalid_url"),
    ({"url": "https://evil.example%2F@example.com/hook"}, "url", "invalid_url"),
    ({"url": "https://user:p%40ss@example.com/hook"}, "url", "invalid_url"),
    ({"url": "https://ex%61mple.com/hook"}, "url", "invalid_url"),
    ({"url": ""}, "url", "invalid_value"),
    ({}, "url", "missing_field"),
    ({"url": "https://example.com", "events": ["task.created"]}, "events[0]", "invalid_value"),
    ({"url": "https://example.com", "events": []}, "events", "invalid_value"),
    ({"url": "https://example.com", "secret": "mine"}, "secret", "unknown_field"),
    ({"url": "https://example.com", "description": "a\nb"}, "description", "invalid_characters"),
])
def test_invalid_registrations_are_422_in_the_one_error_shape(
    client: TestClient, tenant: TenantKey, body: dict[str, Any], param: str, code: str
) -> None:
    r = client.post("/v1/webhooks", headers=tenant.headers, json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert client.get("/v1/webhooks", headers=tenant.headers).json()["data"] == []


def test_an_ambiguous_host_is_refused_saying_how_to_write_it(client: TestClient, tenant: TenantKey,
                                                             resolver: TableResolver) -> None:
    """`\\` or `%2f` before the `@`: this service would reach example.com (the part after the `@`), a parser that
    reads `\\` as `/` or decodes first the host before it. Refused before the name is resolved; the plain form of the
    same host registers."""
    r = client.post("/v1/webhooks", headers=tenant.headers, json={"url": "https://evil.example\\@example.com/hook"})
    assert r.status_code == 422, r.text
    assert r.json() == {"error": {
        "type": "invalid_request_error", "code": "invalid_url", "param": "url",
        "message": "url: the part before the path (user, password, host, port) holds a backslash ('\\'), which URL "
                   "parsers read differently; write the host plainly (an international name in its xn-- form), with "
                   "no escaped user or password, e.g. https://hooks.example.com/loraplane."}}
    assert resolver.asked == []
    assert register(client, tenant, "https://example.com/hook")["url"] == "https://example.com/hook"


def test_a_foreign_webhook_answers_exactly_like_a_missing_one(
    client: TestClient, tenant: TenantKey, other_tenant: TenantKey, receiver: Receiver
) -> None:
    mine = register(client, tenant, receiver.url)
    for path in ("", "/deliveries"):
        foreign = client.get(f"/v1/webhooks/{mine['id']}{path}", headers=other_tenant.headers)
        missing = client.get(f"/v1/webhooks/wh-00000000000000000000{path}", headers=other_tenant.headers)
        assert foreign.status_code == missing.status_code == 404
        assert foreign.json()["error"] == {**missing.json()["error"],
                                           "message": missing.json()["error"]["message"].replace(
                                               "wh-00000000000000000000", mine["id"])}
    assert client.delete(f"/v1/webhooks/{mine['id']}", headers=other_tenant.headers).status_code == 404
    assert client.get("/v1/webhooks", headers=other_tenant.headers).json()["data"] == []
    # The other tenant's events are never sent to this tenant's endpoint.
    cancel(client, other_tenant)
    assert WebhookSender().run_once() == 0 and receiver.requests == []
    assert client.get(f"/v1/webhooks/{mine['id']}", headers=tenant.headers).status_code == 200


# ---- delivery --------------------------------------------------------------------------------------------------


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    bus = get_bus()
    while batch := bus.consume(SCHEDULER_STREAM, "scheduler", "test", count=1000, block_s=0.01):
        bus.ack(SCHEDULER_STREAM, "scheduler", [i for i, _ in batch])
    yield SchedulerDaemon(get_settings(), bus, get_celery(), consumer="test")
    redis.Redis.from_url(REDIS_URL).delete(worker_queue(get_settings(), WORKER))


def report(kind: str, **fields: object) -> None:
    get_bus().publish(SCHEDULER_STREAM, REPORT_TYPES[kind](**{"worker_id": WORKER, **fields}).to_dict())


def test_a_task_run_to_success_sends_signed_deliveries(
    client: TestClient, tenant: TenantKey, daemon: SchedulerDaemon, receiver: Receiver
) -> None:
    hook = register(client, tenant, receiver.url)
    only_failures = register(client, tenant, receiver.url + "/failures", events=["task.failed"])
    task = make_task(client, tenant)
    ids = trial_ids(task["id"])
    # The service path: the scheduler plans and dispatches, the "worker" reports through the bus, ingest records
    # trial.completed and finalize task.succeeded, each event with its deliveries in its transaction.
    report("heartbeat", queue=worker_queue(get_settings(), WORKER), device="cpu", max_slots=8)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        pack_id = s.scalars(select(Pack.id).where(Pack.state.in_(states.PACK_LIVE))).one()
    report("pack.started", pack_id=pack_id)
    for i, trial_id in enumerate(ids):
        report("points", pack_id=pack_id, points=[[trial_id, 2, "val", 1.5 - i / 10]])
        report("trial.finished", pack_id=pack_id, trial_id=trial_id, status="completed", steps_done=2,
               best_val_loss=1.5 - i / 10, best_step=2, final_train_loss=1.8, adapter_key=f"adapters/{trial_id}.tgz")
    report("pack.finished", pack_id=pack_id)
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    assert client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()["state"] == "succeeded"
    assert receiver.requests == []  # nothing is sent by the API or the scheduler's round itself

    assert WebhookSender().run_once() == len(ids) + 1
    assert WebhookSender().run_once() == 0  # each is sent once
    bodies = [assert_signed(r, hook["secret"]) for r in receiver.requests]
    assert {r["path"] for r in receiver.requests} == {"/hook"}
    assert sorted(b["type"] for b in bodies) == ["task.succeeded"] + ["trial.completed"] * len(ids)
    assert sorted(b["trial_id"] for b in bodies if b["type"] == "trial.completed") == sorted(ids)
    (done,) = [b for b in bodies if b["type"] == "task.succeeded"]
    assert done["task_id"] == task["id"] and done["trial_id"] == ids[-1]
    assert done["task"]["state"] == "succeeded" and done["task"]["best_trial_id"] == ids[-1]
    assert done["data"]["best_trial_id"] == ids[-1] and done["created_at"].endswith("Z")
    events = client.get(f"/v1/tasks/{task['id']}/events", headers=tenant.headers, params={"limit": 1000}).json()
    assert done["id"] in [e["id"] for e in events["data"] if e["type"] == "task.succeeded"]

    log = deliveries(client, tenant, hook["id"])
    assert len(log) == len(ids) + 1
    assert {(d["state"], d["attempts"], d["last_status_code"], d["next_attempt_at"]) for d in log} == {
        ("delivered", 1, 200, None)}
    assert all(d["delivered_at"] for d in log)
    assert {d["id"] for d in log} == {r["headers"]["X-Loraplane-Delivery"] for r in receiver.requests}
    assert deliveries(client, tenant, only_failures["id"]) == []  # subscribed to task.failed only
    # The secret was shown once: no later answer carries it.
    for path in (f"/v1/webhooks/{hook['id']}", "/v1/webhooks", f"/v1/webhooks/{hook['id']}/deliveries"):
        assert hook["secret"] not in client.get(path, headers=tenant.headers).text


def test_a_failing_receiver_gets_the_delivery_on_retry_and_the_log_shows_both_attempts(
    client: TestClient, tenant: TenantKey, receiver: Receiver
) -> None:
    hook = register(client, tenant, receiver.url, events=["task.cancelled"])
    task_id = cancel(client, tenant)
    receiver.statuses = [500]
    sender = WebhookSender(backoff_s=(5, 5))
    t0 = utcnow()
    assert sender.run_once(now=t0) == 1
    (d,) = deliveries(client, tenant, hook["id"])
    assert (d["state"], d["attempts"], d["last_status_code"], d["last_error"]) == ("pending", 1, 500, "HTTP 500")
    assert d["delivered_at"] is None and d["next_attempt_at"] is not None
    assert sender.run_once(now=t0 + timedelta(seconds=4)) == 0  # not due before its backoff
    assert sender.run_once(now=t0 + timedelta(seconds=6)) == 1
    (d,) = deliveries(client, tenant, hook["id"])
    assert (d["state"], d["attempts"], d["last_status_code"], d["last_error"]) == ("delivered", 2, 200, None)
    assert len(receiver.requests) == 2
    first, second = (assert_signed(r, hook["secret"]) for r in receiver.requests)
    assert first == second and first["task_id"] == task_id and first["task"]["state"] == "cancelled"
    assert len({r["headers"]["X-Loraplane-Delivery"] for r in receiver.requests}) == 1  # one id to dedupe by


def test_a_receiver_that_never_recovers_fails_after_the_last_attempt(
    client: TestClient, tenant: TenantKey, receiver: Receiver
) -> None:
    hook = register(client, tenant, receiver.url)
    dead = register(client, tenant, "http://127.0.0.1:9/unreachable")  # discard port: connection refused
    cancel(client, tenant)
    receiver.statuses = [503, 503]
    sender = WebhookSender(backoff_s=(1,), timeout_s=2)
    t0 = utcnow()
    assert sender.run_once(now=t0) == 2
    assert sender.run_once(now=t0 + timedelta(seconds=2)) == 2
    assert sender.run_once(now=t0 + timedelta(days=1)) == 0
    (d,) = deliveries(client, tenant, hook["id"])
    assert (d["state"], d["attempts"], d["last_status_code"], d["next_attempt_at"]) == ("failed", 2, 503, None)
    (d,) = deliveries(client, tenant, dead["id"])
    assert (d["state"], d["attempts"], d["last_status_code"]) == ("failed", 2, None)
    # What the tenant is told: that it failed and how, in general terms; not the socket's own error (which would
    # tell a refused port from a reset one), not an address.
    assert d["last_error"] == "delivery failed: could not connect"


def test_a_sender_that_dies_mid_way_loses_nothing(client: TestClient, tenant: TenantKey, receiver: Receiver) -> None:
    hook = register(client, tenant, receiver.url)
    cancel(client, tenant)
    t0 = utcnow()
    # Dies after claiming, before sending: the claim runs out and another sender sends it.
    assert WebhookSender().claim(t0) is not None
    assert WebhookSender().run_once(now=t0) == 0  # claimed: nobody else takes it meanwhile
    # Dies after sending, before recording (an exception between): not marked delivered, so sent again.
    crashing = WebhookSender()

    def crash(*_args: object) -> None:
        raise RuntimeError("killed")

    crashing.record = crash  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        crashing.run_once(now=t0 + timedelta(seconds=CLAIM_S + 1))
    assert len(receiver.requests) == 1
    (d,) = deliveries(client, tenant, hook["id"])
    assert d["state"] == "pending" and d["attempts"] == 0
    assert WebhookSender().run_once(now=t0 + timedelta(seconds=2 * CLAIM_S + 2)) == 1
    (d,) = deliveries(client, tenant, hook["id"])
    assert d["state"] == "delivered" and d["attempts"] == 1
    assert len(receiver.requests) == 2 and receiver.requests[0]["body"] == receiver.requests[1]["body"]


def test_deliveries_are_written_with_their_event_or_not_at_all(client: TestClient, tenant: TenantKey) -> None:
    register(client, tenant, "https://example.com/hook")
    task = make_task(client, tenant)
    with session_scope() as s:
        record_event(s, tenant_id=tenant.id, task_id=task["id"], type="task.failed", message="boom")
        record_event(s, tenant_id=tenant.id, task_id=task["id"], type="task.running", message="not a webhook")
        s.rollback()  # the event's transaction fails: its deliveries go with it
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(WebhookDelivery)) == 0
        record_event(s, tenant_id=tenant.id, task_id=task["id"], type="task.failed", message="boom")
        record_event(s, tenant_id=tenant.id, task_id=task["id"], type="task.running", message="not a webhook")
    with session_scope() as s:
        assert [d.event_type for d in s.scalars(select(WebhookDelivery))] == ["task.failed"]
        assert s.get(Task, task["id"]) is not None


def test_the_scheduler_daemon_sends_deliveries(
    client: TestClient, tenant: TenantKey, daemon: SchedulerDaemon, receiver: Receiver
) -> None:
    """The hook in `SchedulerDaemon.run`, which `loraplane up` and `loraplane scheduler` both run."""
    hook = register(client, tenant, receiver.url)
    cancel(client, tenant)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert receiver.got.wait(15), "the daemon's sender never delivered"
    finally:
        stop.set()
        thread.join(15)
    assert_signed(receiver.requests[0], hook["secret"])


EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE")


def test_delivery_on_sqlite_through_loraplane_scheduler(tmp_path: Path, receiver: Receiver) -> None:
    """The embedded database: a real `loraplane api` and `loraplane scheduler` over one SQLite file."""
    from tests.e2e.procs import cluster, free_port, wait_ready

    # No LORAPLANE_SECRET_KEY either: the embedded mode makes one in its home, which both processes read.
    env = {k: v for k, v in os.environ.items() if k not in (*EMBEDDED_UNSET, "LORAPLANE_SECRET_KEY")}
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN,
                ALLOW_SETTING: "127.0.0.1"})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp_path) as c:
        api = c.start("api", "api", "--host", "127.0.0.1", "--port", str(port))
        wait_ready(base_url, [api])
        assert (tmp_path / "home" / "loraplane.db").is_file()
        c.start("scheduler", "scheduler")
        with httpx.Client(base_url=base_url, timeout=30) as http:
            tenant_id = http.post("/v1/admin/tenants", headers=ADMIN, json={"name": "lite"}).json()["id"]
            key = http.post(f"/v1/admin/tenants/{tenant_id}/api-keys", headers=ADMIN).json()["key"]
            headers = {"Authorization": f"Bearer {key}"}
            hook = http.post("/v1/webhooks", headers=headers, json={"url": receiver.url}).json()
            file_id = http.post("/v1/files", headers=headers, files={"file": ("t.jsonl", chat_rows())}).json()["id"]
            task = http.post("/v1/tasks", headers=headers, json={"base_model": "tiny-random-llama",
                                                                 "training_file": file_id, "max_steps": 2}).json()
            assert http.post(f"/v1/tasks/{task['id']}/cancel", headers=headers).status_code == 200
            assert receiver.got.wait(30), c.logs()
            # Signed by the scheduler with the secret the API encrypted: one key, made once, in the home (0600).
            body = assert_signed(receiver.requests[0], hook["secret"])
            assert body["type"] == "task.cancelled" and body["task_id"] == task["id"]
            assert stat.S_IMODE((tmp_path / "home" / "secret.key").stat().st_mode) == 0o600
            log = http.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=headers).json()["data"]
            assert [d["event_type"] for d in log] == ["task.cancelled"]
