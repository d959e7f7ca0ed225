"""The operator sees a quarantined worker (issue 29): `GET /v1/admin/workers` and `/v1/admin/cluster` show until when
the scheduler gives it no pack and how many packs it lost lately; `DELETE /v1/admin/workers/{id}/quarantine` lifts
it early."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient

from common.db import session_scope
from common.tables import Worker, utcnow
from tests.api.test_api_cluster import add_worker
from tests.factories import ADMIN, TenantKey


def quarantine(worker_id: str, *, for_s: float, lost_ago_s: list[float]) -> None:
    now = utcnow()
    with session_scope() as session:
        worker = session.get_one(Worker, worker_id)
        worker.quarantined_until = now + timedelta(seconds=for_s)
        worker.lost_packs = [now.timestamp() - ago for ago in lost_ago_s]
        worker.quarantines = 1


def workers(client: TestClient) -> dict[str, dict]:
    return {w["id"]: w for w in client.get("/v1/admin/workers", headers=ADMIN).json()["data"]}


def test_a_quarantined_worker_shows_until_when_and_its_lost_packs(client: TestClient) -> None:
    add_worker("gpu-0")
    add_worker("gpu-1")
    add_worker("gpu-2")
    quarantine("gpu-0", for_s=60, lost_ago_s=[5, 20, 700])  # the third loss is older than the 10-minute window
    quarantine("gpu-2", for_s=-1, lost_ago_s=[30])  # its quarantine is over
    listed = workers(client)
    until = listed["gpu-0"]["quarantined_until"]
    assert until is not None and until.endswith("Z") and listed["gpu-0"]["recent_lost_packs"] == 2
    assert (listed["gpu-1"]["quarantined_until"], listed["gpu-1"]["recent_lost_packs"]) == (None, 0)
    assert (listed["gpu-2"]["quarantined_until"], listed["gpu-2"]["recent_lost_packs"]) == (None, 1)
    cluster = client.get("/v1/admin/cluster", headers=ADMIN).json()
    assert cluster["workers_quarantined"] == 1 and cluster["workers_alive"] == 3
    assert {w["id"]: w["quarantined_until"] for w in cluster["workers"]} == {
        "gpu-0": until, "gpu-1": None, "gpu-2": None}


def test_an_operator_lifts_a_quarantine(client: TestClient, tenant: TenantKey) -> None:
    add_worker("gpu-0")
    quarantine("gpu-0", for_s=600, lost_ago_s=[1, 2, 3])
    path = "/v1/admin/workers/gpu-0/quarantine"
    assert client.delete(path).status_code == 401
    assert client.delete(path, headers=tenant.headers).status_code == 403
    for _ in range(2):  # idempotent
        r = client.delete(path, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert (r.json()["id"], r.json()["quarantined_until"], r.json()["recent_lost_packs"]) == ("gpu-0", None, 0)
    with session_scope() as session:
        worker = session.get_one(Worker, "gpu-0")
        assert (worker.quarantined_until, worker.lost_packs, worker.quarantines) == (None, None, 0)
    r = client.delete("/v1/admin/workers/gpu-9/quarantine", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"


def test_an_estimate_waits_for_a_quarantined_worker(client: TestClient, tenant: TenantKey) -> None:
    """The planner gives a quarantined worker no pack until its quarantine ends: the estimate waits as long."""
    from tests.api.test_api_estimates import body
    from tests.factories import upload

    file_id = upload(client, tenant)["id"]
    add_worker("gpu-0")

    def wall_s() -> float:
        answer = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=tenant.headers)
        return float(answer.json()["estimate"]["wall_seconds"])

    free = wall_s()
    quarantine("gpu-0", for_s=600, lost_ago_s=[1, 2, 3])
    assert wall_s() == pytest.approx(free + 600, abs=2)
