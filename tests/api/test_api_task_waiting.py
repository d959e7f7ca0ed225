"""`GET /v1/tasks/{id}` says why a task's pending trials wait (`waiting`), as the scheduler's round recorded it
(scheduler/service/waits.py, run here on the real database), and only while a trial is pending."""

from __future__ import annotations

from fastapi.testclient import TestClient

from common.db import session_scope
from common.settings import get_settings
from common.tables import Trial, utcnow
from scheduler.planning.types import Plan
from scheduler.service.planner_io import build_snapshot
from scheduler.service.waits import note_task_waits
from tests.factories import TenantKey, make_task, trial_ids, update_row


def scheduler_round() -> None:
    """What the daemon's round does after a plan that placed nothing (no worker is alive here)."""
    now = utcnow()
    with session_scope() as s:
        snapshot = build_snapshot(s, now, get_settings().worker_timeout_s)
        note_task_waits(s, snapshot, Plan(), None, now, get_settings().worker_timeout_s)


def test_a_queued_task_says_why_it_waits_until_its_trials_start(client: TestClient, tenant: TenantKey) -> None:
    first = make_task(client, tenant)
    second = make_task(client, tenant)
    assert first["waiting"] is None  # nothing judged yet
    scheduler_round()
    body = client.get(f"/v1/tasks/{second['id']}", headers=tenant.headers).json()
    waiting = body["waiting"]
    assert set(waiting) == {"reason", "message", "position", "estimated_start_at", "waiting_trials", "pack_id",
                            "worker_id", "updated_at"}  # what the scheduler keeps for itself (`told`) is not shown
    assert (waiting["reason"], waiting["position"], waiting["waiting_trials"]) == ("no_worker", 2, 4)
    assert waiting["estimated_start_at"] is None and waiting["updated_at"].endswith("Z")
    assert waiting["message"] == ("4 trials waiting: no usable worker is alive (none, or every one quarantined); "
                                  "2nd in queue")
    listed = client.get("/v1/tasks", headers=tenant.headers).json()["data"]
    assert {t["id"]: t["waiting"]["position"] for t in listed} == {first["id"]: 1, second["id"]: 2}
    events = client.get(f"/v1/tasks/{second['id']}/events", headers=tenant.headers).json()["data"]
    assert [(e["type"], e["data"]["reason"]) for e in events if e["type"] == "task.waiting"] == [
        ("task.waiting", "no_worker")]

    # The first task's trials start: its field is gone at once (before the scheduler's next round clears it)...
    for trial_id in trial_ids(first["id"]):
        update_row(Trial, trial_id, state="running")
    assert client.get(f"/v1/tasks/{first['id']}", headers=tenant.headers).json()["waiting"] is None
    # ...and the next round moves the second up to the head of the queue, which is news: a second event.
    scheduler_round()
    body = client.get(f"/v1/tasks/{second['id']}", headers=tenant.headers).json()
    assert body["waiting"]["position"] == 1 and body["waiting"]["message"].endswith("; 1st in queue")
    events = client.get(f"/v1/tasks/{second['id']}/events", headers=tenant.headers).json()["data"]
    assert [e["data"]["position"] for e in events if e["type"] == "task.waiting"] == [2, 1]
