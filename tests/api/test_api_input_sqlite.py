"""The input cases whose failure looked different on SQLite (the embedded database), against a real
`loraplane api` on a SQLite file: non-finite floats were stored as invalid JSON (201), NUL bytes were
stored, integers past 2^63 raised OverflowError in the driver (500). Each is a 422 there too, and what is
stored stays valid JSON."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.procs import cluster, free_port, wait_ready
from tests.factories import ADMIN, ADMIN_TOKEN, chat_rows

EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE")
OVER_INT64 = str(2**63)


@pytest.fixture(scope="module")
def sqlite_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, dict[str, str], str]]:
    """(an admin client, the tenant's headers, a task id) on a `loraplane api` over a fresh SQLite file."""
    tmp = tmp_path_factory.mktemp("sqlite-api")
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp / "home"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp) as c:
        api = c.start("api", "api", "--host", "127.0.0.1", "--port", str(port))
        wait_ready(base_url, [api])
        assert (Path(env["LORAPLANE_HOME"]) / "loraplane.db").is_file()  # really SQLite
        with httpx.Client(base_url=base_url, timeout=30) as client:
            tenant_id = client.post("/v1/admin/tenants", headers=ADMIN, json={"name": "lite"}).json()["id"]
            key = client.post(f"/v1/admin/tenants/{tenant_id}/api-keys", headers=ADMIN).json()["key"]
            headers = {"Authorization": f"Bearer {key}"}
            file_id = client.post("/v1/files", headers=headers, files={"file": ("t.jsonl", chat_rows())}).json()["id"]
            r = client.post("/v1/tasks", headers={**headers, "Content-Type": "application/json"},
                            content=_task(file_id, '"training": {"max_grad_norm": 1}'))
            assert r.status_code == 201, r.text
            yield client, headers, r.json()["id"]


def _task(file_id: str, fragment: str) -> bytes:
    return (f'{{"base_model": "tiny-random-llama", "training_file": "{file_id}", "max_steps": 2, '
            f'"search_space": {{"learning_rate": [0.001]}}, {fragment}}}').encode()


@pytest.mark.parametrize(("fragment", "param"), [
    ('"training": {"max_grad_norm": Infinity}', "training.max_grad_norm"),
    ('"training": {"max_grad_norm": NaN}', "training.max_grad_norm"),
    ('"training": {"max_grad_norm": 1e400}', "training.max_grad_norm"),
    ('"seed": 9223372036854775808', "seed"),
])
def test_a_non_finite_or_huge_number_is_a_422_on_sqlite(
    sqlite_api: tuple[httpx.Client, dict[str, str], str], fragment: str, param: str
) -> None:
    client, headers, _task_id = sqlite_api
    r = client.post("/v1/tasks", headers={**headers, "Content-Type": "application/json"},
                    content=_task("file-x", fragment))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param
    r = client.get("/v1/tasks", headers=headers)  # every stored row still reads back as JSON
    assert r.status_code == 200 and len(r.json()["data"]) == 1


@pytest.mark.parametrize(("route", "param"), [("events", "after"), ("curves", "after_step"),
                                              ("events/stream", "after")])
def test_an_integer_past_the_column_is_a_422_on_sqlite(
    sqlite_api: tuple[httpx.Client, dict[str, str], str], route: str, param: str
) -> None:
    client, headers, task_id = sqlite_api
    r = client.get(f"/v1/tasks/{task_id}/{route}", params={param: OVER_INT64}, headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param


def test_control_characters_and_a_non_ascii_digit_are_422s_on_sqlite(
    sqlite_api: tuple[httpx.Client, dict[str, str], str],
) -> None:
    client, headers, task_id = sqlite_api
    r = client.post("/v1/admin/tenants", headers=ADMIN, json={"name": "nul\x00name"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_characters"
    raw_headers = [(b"authorization", headers["Authorization"].encode()), (b"last-event-id", b"\xb2")]  # '²'
    r = client.get(f"/v1/tasks/{task_id}/events/stream", headers=raw_headers)
    assert r.status_code == 422 and r.json()["error"]["param"] == "Last-Event-ID"
