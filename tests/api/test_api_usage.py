"""Usage per tenant (issue 18): GPU seconds shared by tokens, windows, trials by final state, storage, isolation.

Packs and the workers' usage reports are written to the real database as the scheduler's ingest writes them
(tests/e2e/test_embedded.py checks the same sums after a real task); the API computes from them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from common.db import session_scope
from common.tables import Pack, Task, TrialUsage
from common.usage import gpu_seconds_by_trial, overlap_s, share_pack, split_overlaps
from tests.factories import ADMIN, TenantKey, make_task, make_tenant, trial_ids, update_row, upload

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def test_a_pack_is_shared_by_tokens_or_equally_and_clipped_to_the_window() -> None:
    assert share_pack(10.0, ["a", "b"], {"a": 300, "b": 100}) == {"a": 7.5, "b": 2.5}
    assert share_pack(9.0, ["a", "b", "c"], {}) == {"a": 3.0, "b": 3.0, "c": 3.0}
    assert share_pack(4.0, ["a", "b"], {"a": 10}) == {"a": 4.0, "b": 0.0}  # b trained nothing it reported
    assert share_pack(4.0, [], {}) == {}
    end = T0 + timedelta(seconds=100)
    assert overlap_s(T0, end, (None, None)) == 100.0
    assert overlap_s(T0, end, (T0 + timedelta(seconds=40), None)) == 60.0
    assert overlap_s(T0, end, (None, T0 + timedelta(seconds=30))) == 30.0
    assert overlap_s(T0, end, (end, None)) == 0.0


@pytest.fixture
def billed(client: TestClient) -> tuple[TenantKey, TenantKey, list[str], list[str]]:
    """Two tenants; one finished pack trained two of A's trials and one of B's (tokens 300, 100, 400: 100 s), a
    second, still running pack one more of A's (no report yet)."""
    a, b = make_tenant(client), make_tenant(client)
    task_a, task_b = make_task(client, a), make_task(client, b)
    ta, tb = trial_ids(task_a["id"]), trial_ids(task_b["id"])
    with session_scope() as s:
        s.add(Pack(id="pack-usage-1", worker_id="w", base_model="tiny-random-llama", state="finished",
                   trial_ids=[ta[0], ta[1], tb[0]], started_at=T0, finished_at=T0 + timedelta(seconds=100)))
        s.add(Pack(id="pack-usage-2", worker_id="w", base_model="tiny-random-llama", state="running",
                   trial_ids=[ta[2]], started_at=T0 + timedelta(seconds=200)))
        for trial_id, task, tenant, tokens in ((ta[0], task_a, a, 300), (ta[1], task_a, a, 100),
                                               (tb[0], task_b, b, 400)):
            s.add(TrialUsage(pack_id="pack-usage-1", trial_id=trial_id, task_id=task["id"], tenant_id=tenant.id,
                             tokens=tokens, steps=3, end_step=3, created_at=T0 + timedelta(seconds=100)))
    update_row(Task, task_b["id"], finished_at=T0 + timedelta(seconds=100), state="succeeded")
    for trial_id in tb:
        from common.tables import Trial

        update_row(Trial, trial_id, state="completed")
    return a, b, ta, tb


def test_usage_shares_each_packs_time_by_tokens_and_sums_to_the_packs(
    client: TestClient, billed: tuple[TenantKey, TenantKey, list[str], list[str]]
) -> None:
    a, b, _, _ = billed
    to = _iso(T0 + timedelta(seconds=300))  # the running pack has run 100 s by then
    ua = client.get(f"/v1/usage?to={to}", headers=a.headers).json()
    ub = client.get(f"/v1/usage?to={to}", headers=b.headers).json()
    assert (ua["object"], ua["tenant_id"], ua["start"], ua["end"]) == ("usage", a.id, None, to)
    assert ua["gpu_seconds"] == pytest.approx(50.0 + 100.0)  # (300 + 100) / 800 of pack 1, all of pack 2
    assert ub["gpu_seconds"] == pytest.approx(50.0)
    assert (ua["tokens"], ub["tokens"]) == (400, 400)
    assert ua["trials"] == {} and ub["trials"] == {"completed": 4}  # only B's task ended
    assert ua["storage_bytes"] > 0 and ub["storage_bytes"] > 0
    everyone = client.get(f"/v1/admin/usage?to={to}", headers=ADMIN).json()
    rows = {u["tenant_id"]: u for u in everyone["data"]}
    assert rows[a.id] == ua and rows[b.id] == ub
    # Every second of every pack is billed to someone, and only once.
    assert sum(u["gpu_seconds"] for u in everyone["data"]) == pytest.approx(100.0 + 100.0)


def test_a_pack_over_several_gpus_counts_each_of_its_gpus(client: TestClient) -> None:
    a = make_tenant(client)
    ta = trial_ids(make_task(client, a)["id"])
    with session_scope() as s:
        s.add(Pack(id="pack-usage-2gpu", worker_id="w2", base_model="tiny-random-llama", state="finished", gpus=2,
                   trial_ids=[ta[0], ta[1]], started_at=T0, finished_at=T0 + timedelta(seconds=100)))
    usage = client.get(f"/v1/usage?to={_iso(T0 + timedelta(seconds=300))}", headers=a.headers).json()
    assert usage["gpu_seconds"] == pytest.approx(200.0)  # 100 s on two GPUs, shared equally (no reports)


def test_a_window_counts_only_the_time_and_reports_inside_it(
    client: TestClient, billed: tuple[TenantKey, TenantKey, list[str], list[str]]
) -> None:
    a, b, _, _ = billed
    window = f"from={_iso(T0 + timedelta(seconds=60))}&to={_iso(T0 + timedelta(seconds=250))}"
    ua = client.get(f"/v1/usage?{window}", headers=a.headers).json()
    assert ua["gpu_seconds"] == pytest.approx(40.0 * 0.5 + 50.0)  # 40 s of pack 1, 50 s of pack 2
    assert ua["tokens"] == 400  # reported at 100 s, inside
    later = client.get(f"/v1/usage?from={_iso(T0 + timedelta(seconds=101))}&to={_iso(T0 + timedelta(seconds=150))}",
                       headers=b.headers).json()
    assert (later["gpu_seconds"], later["tokens"], later["trials"]) == (0.0, 0, {})


def test_usage_refuses_a_bad_window_and_the_admin_view_needs_the_admin_token(client: TestClient) -> None:
    tenant = make_tenant(client)
    upload(client, tenant)
    r = client.get(f"/v1/usage?from={_iso(T0)}&to={_iso(T0)}", headers=tenant.headers)
    assert r.status_code == 422 and r.json()["error"]["param"] == "from", r.text
    r = client.get("/v1/usage?from=yesterday", headers=tenant.headers)
    assert r.status_code == 422 and r.json()["error"]["param"] == "from", r.text
    assert client.get("/v1/usage").status_code == 401
    assert client.get("/v1/admin/usage", headers=tenant.headers).status_code in (401, 403)
    fresh = client.get("/v1/usage", headers=tenant.headers).json()
    assert (fresh["gpu_seconds"], fresh["tokens"], fresh["trials"]) == (0.0, 0, {})
    assert fresh["storage_bytes"] > 0


def test_packs_side_by_side_on_one_gpu_share_its_seconds(client: TestClient) -> None:
    """Issue 34: while two packs of two models run at once on one worker, each counts half of that time: a GPU
    second is billed once. A's pack 0-100 s, B's 50-150 s on the same worker: 75 s each; a pack on another worker
    over the same time is billed whole."""
    assert split_overlaps([("a", 0.0, 100.0), ("b", 50.0, 150.0)]) == {"a": 75.0, "b": 75.0}
    assert split_overlaps([("a", 0.0, 10.0), ("b", 0.0, 10.0), ("c", 0.0, 10.0)]) == {"a": 10 / 3, "b": 10 / 3,
                                                                                      "c": 10 / 3}
    assert split_overlaps([("a", 5.0, 5.0), ("b", 0.0, 1.0)]) == {"a": 0.0, "b": 1.0}
    a, b = make_tenant(client), make_tenant(client)
    ta, tb = trial_ids(make_task(client, a)["id"]), trial_ids(make_task(client, b)["id"])
    with session_scope() as s:
        for pack_id, worker, trial, start in (("pack-beside-a", "gpu-0", ta[0], 0),
                                              ("pack-beside-b", "gpu-0", tb[0], 50),
                                              ("pack-elsewhere", "gpu-1", tb[1], 50)):
            s.add(Pack(id=pack_id, worker_id=worker, base_model="tiny-random-llama", state="finished",
                       trial_ids=[trial], started_at=T0 + timedelta(seconds=start),
                       finished_at=T0 + timedelta(seconds=start + 100)))
    window = f"from={_iso(T0)}&to={_iso(T0 + timedelta(seconds=1000))}"
    seconds = {}
    for tenant in (a, b):
        r = client.get(f"/v1/usage?{window}", headers=tenant.headers)
        assert r.status_code == 200, r.text
        seconds[tenant.id] = r.json()["gpu_seconds"]
    assert seconds == {a.id: 75.0, b.id: 75.0 + 100.0}
    with session_scope() as s:
        assert gpu_seconds_by_trial(s, (T0, T0 + timedelta(seconds=75))) == {ta[0]: 62.5, tb[0]: 12.5, tb[1]: 25.0}
