"""Every request body the API reads whole is bounded (api/limits.py): past LORAPLANE_MAX_REQUEST_BYTES a
declared or a chunked body answers 413 in the one error shape and nothing is written; the streamed upload keeps
its own, larger limits."""

from __future__ import annotations

import json
from collections.abc import Iterator

from fastapi.testclient import TestClient

from common.settings import get_settings
from common.tables import Task
from tests.factories import TenantKey, count_rows, task_body, upload


def padded_task(file_id: str, size: int) -> bytes:
    """A valid task body padded to `size` bytes with JSON whitespace: only its size is wrong."""
    body = json.dumps(task_body(file_id)).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def assert_too_large(response_status: int, body: dict) -> None:
    assert response_status == 413, body
    limit = get_settings().max_request_bytes
    assert body["error"] == {"type": "invalid_request_error", "code": "request_too_large", "param": None,
                             "message": f"The request body is larger than the limit of {limit} bytes.", "limit": limit}


def test_a_declared_body_over_the_limit_is_refused_unread(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    limit = get_settings().max_request_bytes
    r = client.post("/v1/tasks", headers={**tenant.headers, "content-type": "application/json"},
                    content=padded_task(file_id, limit + 1))
    assert_too_large(r.status_code, r.json())
    assert count_rows(Task) == 0
    # The same body at the limit is an ordinary task.
    r = client.post("/v1/tasks", headers={**tenant.headers, "content-type": "application/json"},
                    content=padded_task(file_id, limit))
    assert r.status_code == 201, r.text


def test_a_chunked_body_is_cut_off_as_it_passes_the_limit(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    body = padded_task(file_id, 4 * get_settings().max_request_bytes)
    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding chunked
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]

    r = client.post("/v1/tasks", headers={**tenant.headers, "content-type": "application/json"}, content=chunks())
    assert_too_large(r.status_code, r.json())
    assert count_rows(Task) == 0


def test_the_upload_streams_past_the_request_limit(client: TestClient, tenant: TenantKey) -> None:
    row = json.dumps({"prompt": "p" * 1000, "completion": "c" * 1000}).encode() + b"\n"
    data = row * (get_settings().max_request_bytes // len(row) + 10)
    assert len(data) > get_settings().max_request_bytes
    created = upload(client, tenant, data)
    assert created["bytes"] == len(data)
