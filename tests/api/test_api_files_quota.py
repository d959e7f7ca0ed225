"""The per-tenant storage quota: bytes and number of live files, set by the operator, held under races."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from common.artifacts import get_artifact_store
from common.db import session_scope
from common.settings import get_settings
from common.tables import File
from tests.factories import ADMIN, TenantKey, chat_rows, make_tenant, upload

DATA = chat_rows(20)  # every upload here has this size


def _post(client: TestClient, tenant: TenantKey) -> Any:
    return client.post("/v1/files", headers=tenant.headers, files={"file": ("d.jsonl", DATA)})


def _live_files(tenant: TenantKey) -> tuple[int, int]:
    with session_scope() as s:
        files, used = s.execute(select(func.count(), func.coalesce(func.sum(File.bytes), 0))
                                .where(File.tenant_id == tenant.id, File.deleted_at.is_(None))).one()
    return int(files), int(used)


def _stored_objects() -> set[str]:
    """Every object and staged temporary in the store's files/ (a refused upload must leave neither)."""
    root = get_artifact_store().root / "files"
    return {p.name for p in root.iterdir()} if root.exists() else set()


def test_tenants_carry_storage_quotas_with_defaults_from_settings(client: TestClient) -> None:
    settings = get_settings()
    made = client.post("/v1/admin/tenants", json={"name": "a"}, headers=ADMIN).json()
    assert (made["max_storage_bytes"], made["max_files"]) == (settings.default_max_storage_bytes,
                                                              settings.default_max_files)
    made = client.post("/v1/admin/tenants", json={"name": "b", "max_storage_bytes": 5000, "max_files": 3},
                       headers=ADMIN).json()
    assert (made["max_storage_bytes"], made["max_files"]) == (5000, 3)
    r = client.patch(f"/v1/admin/tenants/{made['id']}", json={"max_files": 7}, headers=ADMIN)
    assert (r.json()["max_storage_bytes"], r.json()["max_files"]) == (5000, 7)
    assert client.get(f"/v1/admin/tenants/{made['id']}", headers=ADMIN).json()["max_files"] == 7
    for field in ("max_storage_bytes", "max_files"):
        r = client.post("/v1/admin/tenants", json={"name": "c", field: 0}, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["param"]) == (422, field)


def test_storage_bytes_quota_answers_413_and_a_deletion_frees_it(client: TestClient) -> None:
    tenant = make_tenant(client, max_storage_bytes=2 * len(DATA) + len(DATA) // 2)
    first, _second = upload(client, tenant, DATA), upload(client, tenant, DATA)
    before = _stored_objects()
    r = _post(client, tenant)
    assert r.status_code == 413
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "storage_quota_exceeded",
                                                             "file")
    assert (error["limit"], error["usage"]) == (2 * len(DATA) + len(DATA) // 2, 2 * len(DATA))
    assert str(error["limit"]) in error["message"] and str(error["usage"]) in error["message"]
    assert _stored_objects() == before and _live_files(tenant) == (2, 2 * len(DATA))

    assert client.delete(f"/v1/files/{first['id']}", headers=tenant.headers).status_code == 200
    assert _post(client, tenant).status_code == 201
    assert _live_files(tenant) == (2, 2 * len(DATA))


def test_file_count_quota_answers_429_and_a_deletion_frees_it(client: TestClient) -> None:
    tenant = make_tenant(client, max_files=2)
    first, _second = upload(client, tenant, DATA), upload(client, tenant, DATA)
    r = _post(client, tenant)
    assert r.status_code == 429
    error = r.json()["error"]
    assert (error["type"], error["code"], error["limit"], error["usage"]) == (
        "rate_limit_error", "file_quota_exceeded", 2, 2)
    assert client.delete(f"/v1/files/{first['id']}", headers=tenant.headers).status_code == 200
    assert _post(client, tenant).status_code == 201
    assert _live_files(tenant)[0] == 2


def test_a_quota_counts_only_its_own_tenant(client: TestClient) -> None:
    small = make_tenant(client, max_files=1)
    other = make_tenant(client)
    upload(client, other, DATA)
    assert _post(client, small).status_code == 201
    assert _post(client, small).status_code == 429
    assert _post(client, other).status_code == 201


@pytest.mark.parametrize(
    ("quota", "refusal"),
    [({"max_files": 2}, (429, "file_quota_exceeded")),
     ({"max_storage_bytes": 2 * len(DATA) + len(DATA) // 2}, (413, "storage_quota_exceeded"))],
    ids=["files", "bytes"],
)
def test_concurrent_uploads_at_the_quota_edge_do_not_overshoot_it(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, quota: dict[str, int], refusal: tuple[int, str]
) -> None:
    tenant = make_tenant(client, "edge", **quota)
    uploads = 5
    # Every upload passes the first check before any goes on: only the check under the tenant's lock stands
    # between them and the quota. And that check is slowed between reading the usage and inserting, so that
    # without the lock they would all read the same usage and all fit.
    all_checked = threading.Barrier(uploads)
    received = threading.local()
    from api.services import files

    receive, storage_usage = files._receive, files.storage_usage

    def receive_together(*args: Any, **kwargs: Any) -> Any:
        all_checked.wait(timeout=30)
        result = receive(*args, **kwargs)
        received.done = True
        return result

    def usage_then_pause(*args: Any, **kwargs: Any) -> Any:
        usage = storage_usage(*args, **kwargs)
        if getattr(received, "done", False):
            time.sleep(0.3)
        return usage

    monkeypatch.setattr(files, "_receive", receive_together)
    monkeypatch.setattr(files, "storage_usage", usage_then_pause)
    before = _stored_objects()
    with ThreadPoolExecutor(uploads) as pool:
        answers = list(pool.map(lambda _: _post(client, tenant), range(uploads)))
    codes: Iterable[tuple[int, str]] = [(r.status_code, r.json().get("error", {}).get("code", "")) for r in answers]
    assert sorted(codes) == [(201, "")] * 2 + [refusal] * 3
    assert _live_files(tenant) == (2, 2 * len(DATA))
    created = {f"{r.json()['id']}.jsonl" for r in answers if r.status_code == 201}
    assert _stored_objects() == before | created  # the refused ones' content is gone, staged or published
