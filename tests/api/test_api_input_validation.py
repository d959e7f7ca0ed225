"""Hostile and out-of-range input, case by case: each answers a 4xx in the one error shape naming the field,
never a 500 or a cut-off stream. Numbers past a column's range, non-finite floats, control characters in
text and ids, `true` where a number is meant, a non-ASCII Last-Event-ID; the database's own refusals as a
last line of defence; OPTIONS and 405 per HTTP."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient
from starlette.types import Message

from tests.factories import ADMIN, TenantKey, make_task, task_body, trial_ids, upload

INT32_OVER = str(2**31)  # past an INTEGER column (steps)
INT64_OVER = str(2**63)  # past a BIGINT column (event ids)


def _error(r: Any, status: int = 422) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert {"type", "code", "message", "param"} <= set(body["error"])
    return dict(body["error"])


def raw_get(client: TestClient, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[str, Any]]:
    """GET through the ASGI interface with header bytes exactly as given, as a server hands them over (a test
    client re-encodes a non-ASCII header as UTF-8). Returns the status and the JSON body."""
    scope: dict[str, Any] = {"type": "http", "http_version": "1.1", "method": "GET", "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    sent: list[Message] = []
    requested = False

    async def receive() -> Message:
        nonlocal requested
        if requested:  # the client is gone once the request was read: a stream that started ends at once
            return {"type": "http.disconnect"}
        requested = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    async def call() -> None:
        await client.app(scope, receive, send)

    anyio.run(call)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if sent[0]["status"] != 200 else {}


@pytest.fixture
def task(client: TestClient, tenant: TenantKey) -> dict[str, Any]:
    return make_task(client, tenant)


# ---- integers in queries: within the column's range, or a 422 ---------------------------------------------

QUERY_CASES = [
    ("events", "after", INT64_OVER),
    ("events", "after", "-1"),
    ("events", "limit", INT64_OVER),
    ("events/stream", "after", INT64_OVER),  # was a 200 whose body was cut off when the first poll failed
    ("metrics", "step_from", INT32_OVER),
    ("metrics", "step_to", INT64_OVER),
    ("metrics", "step_to", "-1"),
    ("curves", "after_step", INT32_OVER),  # a streamed body as well
    ("curves", "after_step", "1e3"),
]


@pytest.mark.parametrize(("route", "param", "value"), QUERY_CASES)
def test_an_integer_query_out_of_range_is_a_422(
    client: TestClient, tenant: TenantKey, task: dict, route: str, param: str, value: str
) -> None:
    if route == "metrics":
        route = f"trials/{trial_ids(task['id'])[0]}/metrics"
    r = client.get(f"/v1/tasks/{task['id']}/{route}", params={param: value}, headers=tenant.headers)
    error = _error(r)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_value", param)


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/tasks", "limit"), ("/v1/files", "limit"), ("/v1/admin/tenants", "limit"), ("/v1/admin/packs", "limit"),
])
def test_a_page_size_out_of_range_is_a_422(client: TestClient, tenant: TenantKey, path: str, param: str) -> None:
    headers = ADMIN if path.startswith("/v1/admin") else tenant.headers
    assert _error(client.get(path, params={param: INT64_OVER}, headers=headers))["param"] == param


def test_the_largest_values_in_range_are_answered(client: TestClient, tenant: TenantKey, task: dict) -> None:
    base = f"/v1/tasks/{task['id']}"
    r = client.get(f"{base}/events", params={"after": str(2**63 - 1)}, headers=tenant.headers)
    assert r.status_code == 200 and r.json()["data"] == []
    trial = trial_ids(task["id"])[0]
    r = client.get(f"{base}/trials/{trial}/metrics", params={"step_from": str(2**31 - 1)}, headers=tenant.headers)
    assert r.status_code == 200 and r.json()["train"] == []
    r = client.get(f"{base}/curves", params={"after_step": str(2**31 - 1)}, headers=tenant.headers)
    assert r.status_code == 200
    assert len(r.text.splitlines()) == len(trial_ids(task["id"]))  # every trial's line, complete


# ---- Last-Event-ID: ASCII digits within range ------------------------------------------------------------

@pytest.mark.parametrize("value", [
    b"\xb2",  # '²' as a server decodes the byte (latin-1): str.isdigit() says yes, int() refuses it
    b"\xb9\xb2",  # '¹²'
    "٣".encode(),  # an Arabic-Indic three, as UTF-8 bytes
    b"12a", b"-1", b" 7", b"+7", INT64_OVER.encode(), b"1" * 20,
])
def test_a_last_event_id_that_is_no_event_id_is_a_422(
    client: TestClient, tenant: TenantKey, task: dict, value: bytes
) -> None:
    headers = [(b"authorization", f"Bearer {tenant.key}".encode()), (b"last-event-id", value)]
    status, body = raw_get(client, f"/v1/tasks/{task['id']}/events/stream", headers)
    assert status == 422, body
    assert (body["error"]["code"], body["error"]["param"]) == ("invalid_value", "Last-Event-ID")


def test_a_valid_or_empty_last_event_id_resumes_the_stream(client: TestClient, tenant: TenantKey, task: dict) -> None:
    client.post(f"/v1/tasks/{task['id']}/cancel", headers=tenant.headers)  # final: the stream ends by itself
    ids = [e["id"] for e in client.get(f"/v1/tasks/{task['id']}/events", headers=tenant.headers).json()["data"]]
    assert len(ids) >= 2

    def streamed(last_event_id: str) -> list[int]:
        r = client.get(f"/v1/tasks/{task['id']}/events/stream",
                       headers={**tenant.headers, "Last-Event-ID": last_event_id})
        assert r.status_code == 200 and "event: end" in r.text
        return [int(line[4:]) for line in r.text.splitlines() if line.startswith("id: ")]

    assert streamed("") == ids  # no id seen yet: from the start
    assert streamed(str(ids[0])) == ids[1:]
    assert streamed(str(2**63 - 1)) == []


# ---- floats in bodies: finite, and numbers only ----------------------------------------------------------

FLOAT_CASES = [
    ('"training": {"max_grad_norm": Infinity}', "training.max_grad_norm"),
    ('"training": {"max_grad_norm": -Infinity}', "training.max_grad_norm"),
    ('"training": {"max_grad_norm": NaN}', "training.max_grad_norm"),
    ('"training": {"max_grad_norm": 1e400}', "training.max_grad_norm"),  # Python's JSON parser: inf
    ('"training": {"max_grad_norm": true}', "training.max_grad_norm"),
    ('"training": {"max_grad_norm": "1.0"}', "training.max_grad_norm"),
    ('"training": {"weight_decay": NaN}', "training.weight_decay"),
    ('"validation_split": NaN', "validation_split"),
    ('"search_space": {"learning_rate": [0.001, Infinity]}', "search_space.learning_rate[1]"),
    ('"search_space": {"learning_rate": [NaN]}', "search_space.learning_rate[0]"),
    ('"search_space": {"lora_alpha": {"min": 1, "max": Infinity, "num": 2}}', "search_space.lora_alpha.max"),
    ('"search_space": {"lora_dropout": {"min": NaN, "max": 0.1, "num": 2}}', "search_space.lora_dropout.min"),
    ('"early_exit": {"policy": "alto", "tau_gap": Infinity}', "early_exit.tau_gap"),
    ('"early_exit": {"policy": "alto", "tau_slope": NaN}', "early_exit.tau_slope"),
    ('"epochs": true', "epochs"),
    ('"max_steps": 1e400', "max_steps"),
    ('"seed": 2.0', "seed"),
]


@pytest.mark.parametrize(("fragment", "param"), FLOAT_CASES)
def test_a_non_finite_or_mistyped_number_in_a_task_is_a_422(
    client: TestClient, tenant: TenantKey, fragment: str, param: str
) -> None:
    file_id = upload(client, tenant)["id"]
    base = json.dumps(task_body(file_id, search_space={"learning_rate": [1e-4]}))
    body = base[:-1] + ", " + fragment + "}"  # a later key wins: the fragment replaces the default
    r = client.post("/v1/tasks", headers={**tenant.headers, "Content-Type": "application/json"}, content=body)
    error = _error(r)
    assert (error["code"], error["param"]) == ("invalid_value", param)
    assert client.get("/v1/tasks", headers=tenant.headers).json()["data"] == []  # nothing was stored


@pytest.mark.parametrize("body", [
    '{"name": "x", "max_files": 1' + "0" * 5000 + "}",  # past Python's 4,300-digit limit on int()
    '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}",  # past the parser's recursion limit
])
def test_a_body_the_json_parser_cannot_take_is_a_400(client: TestClient, body: str) -> None:
    r = client.post("/v1/admin/tenants", headers={**ADMIN, "Content-Type": "application/json"}, content=body)
    assert _error(r, 400)["type"] == "invalid_request_error"


def test_an_integer_is_a_fine_float(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    body = task_body(file_id, training={"max_grad_norm": 1, "weight_decay": 0}, validation_split=0.25)
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert r.status_code == 201, r.text
    assert r.json()["training"]["max_grad_norm"] == 1.0


TENANT_FIELD_CASES = [
    ('"weight": Infinity', "weight"),
    ('"weight": NaN', "weight"),
    ('"weight": true', "weight"),
    ('"max_concurrent_trials": true', "max_concurrent_trials"),
    ('"max_trials_per_task": "5"', "max_trials_per_task"),
    ('"max_trials_per_task": 5.0', "max_trials_per_task"),
    ('"max_file_bytes": 9223372036854775808', "max_file_bytes"),
    ('"max_file_bytes": 1e400', "max_file_bytes"),
]


@pytest.mark.parametrize(("fragment", "param"), TENANT_FIELD_CASES)
def test_a_tenant_quota_or_weight_must_be_a_finite_json_number(client: TestClient, fragment: str, param: str) -> None:
    body = '{"name": "strict", ' + fragment + "}"
    r = client.post("/v1/admin/tenants", headers={**ADMIN, "Content-Type": "application/json"}, content=body)
    assert _error(r)["param"] == param
    tenant_id = client.post("/v1/admin/tenants", headers=ADMIN, json={"name": "patched"}).json()["id"]
    r = client.patch(f"/v1/admin/tenants/{tenant_id}", headers={**ADMIN, "Content-Type": "application/json"},
                     content="{" + fragment + "}")
    assert _error(r)["param"] == param


def test_a_tenant_weight_may_be_an_integer(client: TestClient) -> None:
    r = client.post("/v1/admin/tenants", headers=ADMIN, json={"name": "int-weight", "weight": 2})
    assert r.status_code == 201 and r.json()["weight"] == 2.0


# ---- text: no control characters ------------------------------------------------------------------------

CONTROL_TEXTS = ["a\x00b", "\x1b[31mred\x1b[0m", "ring\x07", "two\nlines", "del\x7f", "csi\x9b31m"]


@pytest.mark.parametrize("text", CONTROL_TEXTS)
def test_control_characters_in_names_are_a_422(client: TestClient, tenant: TenantKey, text: str) -> None:
    error = _error(client.post("/v1/admin/tenants", headers=ADMIN, json={"name": text}))
    assert (error["code"], error["param"]) == ("invalid_characters", "name")
    error = _error(client.patch(f"/v1/admin/tenants/{tenant.id}", headers=ADMIN, json={"name": text}))
    assert (error["code"], error["param"]) == ("invalid_characters", "name")
    error = _error(client.post(f"/v1/admin/tenants/{tenant.id}/api-keys", headers=ADMIN, json={"name": text}))
    assert (error["code"], error["param"]) == ("invalid_characters", "name")


@pytest.mark.parametrize("field", ["base_model", "training_file", "validation_file"])
def test_control_characters_in_task_references_are_a_422(client: TestClient, tenant: TenantKey, field: str) -> None:
    body = {**task_body("file-x"), field: "file-\x00\x1b"}
    error = _error(client.post("/v1/tasks", headers=tenant.headers, json=body))
    assert (error["code"], error["param"]) == ("invalid_characters", field)


def test_printable_unicode_names_are_kept(client: TestClient) -> None:
    r = client.post("/v1/admin/tenants", headers=ADMIN, json={"name": "  Zoë 東京 🚀  "})
    assert r.status_code == 201 and r.json()["name"] == "Zoë 東京 🚀"


def test_an_idempotency_key_with_control_characters_is_a_422(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    r = client.post("/v1/tasks", headers={**tenant.headers, "Idempotency-Key": "key\x1b[2J"},
                    json=task_body(file_id))
    assert (_error(r)["code"], _error(r)["param"]) == ("invalid_characters", "Idempotency-Key")


PATH_ID_CASES = [
    ("GET", "/v1/tasks/{bad}", "task_id"),
    ("POST", "/v1/tasks/{bad}/cancel", "task_id"),
    ("GET", "/v1/tasks/{bad}/adapter", "task_id"),
    ("GET", "/v1/tasks/{bad}/trials", "task_id"),
    ("GET", "/v1/tasks/{task}/trials/{bad}", "trial_id"),
    ("GET", "/v1/tasks/{task}/trials/{bad}/metrics", "trial_id"),
    ("GET", "/v1/tasks/{bad}/events", "task_id"),
    ("GET", "/v1/tasks/{bad}/events/stream", "task_id"),
    ("GET", "/v1/tasks/{bad}/curves", "task_id"),
    ("GET", "/v1/files/{bad}", "file_id"),
    ("DELETE", "/v1/files/{bad}", "file_id"),
    ("GET", "/v1/models/{bad}", "name"),
    ("GET", "/v1/admin/tenants/{bad}", "tenant_id"),
    ("PATCH", "/v1/admin/tenants/{bad}", "tenant_id"),
    ("GET", "/v1/admin/tenants/{bad}/api-keys", "tenant_id"),
    ("POST", "/v1/admin/tenants/{bad}/api-keys", "tenant_id"),
    ("DELETE", "/v1/admin/api-keys/{bad}", "key_id"),
    ("GET", "/v1/admin/packs/{bad}", "pack_id"),
]


BAD_IDS = ["task-%00", "%1B%5B2J", "x%07"]  # NUL (a Postgres DataError before), an ANSI escape, bell


@pytest.mark.parametrize(("method", "template", "param", "bad"),
                         [(*case, BAD_IDS[i % len(BAD_IDS)]) for i, case in enumerate(PATH_ID_CASES)])
def test_control_characters_in_a_path_id_are_a_422_not_a_database_error(
    client: TestClient, tenant: TenantKey, task: dict, method: str, template: str, param: str, bad: str
) -> None:
    path = template.format(bad=bad, task=task["id"])
    headers = ADMIN if path.startswith("/v1/admin") else tenant.headers
    json_body: dict[str, Any] | None = {} if method in ("PATCH", "POST") else None
    error = _error(client.request(method, path, headers=headers, json=json_body))
    assert (error["code"], error["param"]) == ("invalid_characters", param)


def test_an_overlong_path_id_is_a_422(client: TestClient, tenant: TenantKey) -> None:
    error = _error(client.get(f"/v1/tasks/task-{'a' * 300}", headers=tenant.headers))
    assert (error["code"], error["param"]) == ("invalid_value", "task_id")


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/files", "/v1/admin/tenants"])
def test_control_characters_in_a_page_cursor_are_a_422(client: TestClient, tenant: TenantKey, path: str) -> None:
    headers = ADMIN if path.startswith("/v1/admin") else tenant.headers
    error = _error(client.get(path, params={"after": "task-\x00"}, headers=headers))
    assert (error["code"], error["param"]) == ("invalid_characters", "after")


# ---- the database's refusals: a 4xx or a 503, never a 500 ------------------------------------------------

def test_a_value_the_database_refuses_is_a_422_and_an_outage_a_503_with_retry_after(clean_db: None) -> None:
    from sqlalchemy import select
    from sqlalchemy.exc import OperationalError

    from api.db import session_factory
    from api.main import create_app
    from common.tables import Tenant

    app = create_app()

    @app.get("/nul")
    def nul() -> None:  # a check the schemas lack: Postgres refuses the NUL itself
        with session_factory()() as session:
            session.scalar(select(Tenant).where(Tenant.id == "a\x00b"))

    @app.get("/down")
    def down() -> None:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    with TestClient(app, raise_server_exceptions=False) as c:
        error = _error(c.get("/nul"))
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")
        r = c.get("/down")
        assert _error(r, 503)["code"] == "database_unavailable"
        assert r.headers["Retry-After"].isdigit()


# ---- OPTIONS and 405 per HTTP ---------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "allow"), [
    ("/v1/files", "GET, POST, OPTIONS"),  # FastAPI's routes take no HEAD unless they declare it
    ("/v1/files/file-x", "GET, DELETE, OPTIONS"),
    ("/v1/tasks/task-x", "GET, OPTIONS"),
    ("/v1/admin/tenants/tenant-x", "GET, PATCH, DELETE, OPTIONS"),
    ("/v1/admin/models/org/model/restore", "POST, OPTIONS"),
    ("/v1/models/org/model", "GET, OPTIONS"),
    ("/", "GET, OPTIONS"),
    ("/static/style.css", "GET, HEAD, OPTIONS"),  # static files do
])
def test_options_and_405_list_every_method_of_the_path(client: TestClient, path: str, allow: str) -> None:
    r = client.options(path)
    assert r.status_code == 204 and r.content == b""
    assert r.headers["Allow"] == allow
    r = client.put(path)
    assert _error(r, 405)["code"] == "method_not_allowed"
    assert r.headers["Allow"] == allow


def test_options_of_an_unknown_path_is_a_404(client: TestClient) -> None:
    assert _error(client.options("/v1/nope"), 404)["code"] == "route_not_found"
