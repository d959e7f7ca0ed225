"""Reading, listing and cancelling tasks as the scheduler and workers move them along."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient

from common.bus import SCHEDULER_STREAM, get_bus
from common.messages import Wake
from common.tables import Task, Trial, utcnow
from tests.factories import TenantKey, make_task, trial_ids, update_row, upload


def test_task_reports_counts_progress_best_trial_and_eta(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, validation_split=0.1)  # 4 trials of 6 steps (9 of 10 rows, batch 4, 2 epochs)
    ids = trial_ids(task["id"])
    update_row(Trial, ids[0], state="completed", steps_done=6, best_val_loss=0.42, best_step=5, selection_loss=0.45)
    update_row(Trial, ids[1], state="running", steps_done=3)
    update_row(Task, task["id"], state="running", started_at=utcnow() - timedelta(seconds=100), best_trial_id=ids[0])

    body = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert body["state"] == "running"
    assert body["trial_counts"] == {"pending": 2, "running": 1, "waiting": 0, "completed": 1, "stopped_early": 0,
                                    "failed": 0, "cancelled": 0}
    assert body["progress"] == 0.375  # (1 + 3/6) / 4
    assert body["best_trial"] == {
        "id": ids[0], "best_val_loss": 0.42, "best_step": 5, "metric_score": None, "selection_loss": 0.45,
        "hyperparameters": client.get(f"/v1/tasks/{task['id']}/trials/{ids[0]}",
                                      headers=tenant.headers).json()["hyperparameters"],
    }
    # elapsed x (1 - p) / p = 100 x 0.625 / 0.375 = 166.7 (plus the test's own few milliseconds)
    assert 166 <= body["estimated_seconds_left"] <= 170
    assert body["started_at"].endswith("Z")


def test_best_trial_so_far_is_the_lowest_validation_loss_while_running(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    ids = trial_ids(task["id"])
    update_row(Trial, ids[0], state="running", steps_done=3, best_val_loss=0.9, best_step=3)
    update_row(Trial, ids[1], state="running", steps_done=3, best_val_loss=0.7, best_step=3)
    update_row(Trial, ids[2], state="running", steps_done=3, best_val_loss=0.8, best_step=3)
    update_row(Task, task["id"], state="running", started_at=utcnow())
    body = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert body["best_trial"]["id"] == ids[1] and body["best_trial"]["best_val_loss"] == 0.7
    # The smoothed score ranks where a trial has one (issue 33): trial 1's low point was one lucky evaluation.
    update_row(Trial, ids[1], selection_loss=0.95)
    update_row(Trial, ids[2], selection_loss=0.85)
    body = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert body["best_trial"]["id"] == ids[2] and body["best_trial"]["selection_loss"] == 0.85
    listed = client.get("/v1/tasks", headers=tenant.headers).json()["data"][0]
    assert listed["best_trial"]["id"] == ids[2]


def test_best_trial_so_far_is_the_highest_metric_score_for_a_generative_metric(
    client: TestClient, tenant: TenantKey
) -> None:
    task = make_task(client, tenant, evaluation={"metric": "contains"})
    loss_task = make_task(client, tenant)
    for t in (task, loss_task):
        ids = trial_ids(t["id"])
        update_row(Trial, ids[0], state="running", steps_done=3, best_val_loss=0.9, best_step=3)
        update_row(Trial, ids[1], state="completed", steps_done=6, best_val_loss=0.7, best_step=6, metric_score=0.25)
        update_row(Trial, ids[2], state="completed", steps_done=6, best_val_loss=0.8, best_step=6, metric_score=0.5)
        update_row(Trial, ids[3], state="completed", steps_done=6, best_val_loss=0.75, best_step=6, metric_score=0.5)
        update_row(Task, t["id"], state="running", started_at=utcnow())
    ids = trial_ids(task["id"])
    body = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    # The highest score; of the two at 0.5 the lower validation loss. A trial not scored yet ranks last.
    assert body["best_trial"]["id"] == ids[3] and body["best_trial"]["metric_score"] == 0.5
    assert body["evaluation"] == {"metric": "contains", "max_new_tokens": 32, "pattern": None}
    listed = {t["id"]: t for t in client.get("/v1/tasks", headers=tenant.headers).json()["data"]}
    assert listed[task["id"]]["best_trial"]["id"] == ids[3]
    # The same trials judged by loss: the lowest validation loss, whatever the scores.
    assert listed[loss_task["id"]]["best_trial"]["id"] == trial_ids(loss_task["id"])[1]


def test_finished_and_stopped_trials_count_fully(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    for trial_id, state in zip(trial_ids(task["id"]), ["completed", "stopped_early", "failed", "cancelled"],
                               strict=True):
        update_row(Trial, trial_id, state=state, steps_done=1)
    update_row(Task, task["id"], state="succeeded", finished_at=utcnow())
    body = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert body["progress"] == 1.0 and body["estimated_seconds_left"] is None


def test_list_tasks_newest_first_with_cursor_and_state_filter(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    ids = [make_task(client, tenant, file["id"], search_space={})["id"] for _ in range(3)]
    update_row(Task, ids[0], state="running")
    page = client.get("/v1/tasks?limit=2", headers=tenant.headers).json()
    assert [t["id"] for t in page["data"]] == [ids[2], ids[1]] and page["has_more"] is True
    rest = client.get(f"/v1/tasks?limit=2&after={ids[1]}", headers=tenant.headers).json()
    assert [t["id"] for t in rest["data"]] == [ids[0]] and rest["has_more"] is False
    running = client.get("/v1/tasks?state=running", headers=tenant.headers).json()
    assert [t["id"] for t in running["data"]] == [ids[0]]
    assert running["data"][0]["trial_counts"]["pending"] == 1
    r = client.get("/v1/tasks?state=sleeping", headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["param"]) == (422, "state")


def test_cancel_task_cancels_unfinished_trials_and_wakes_the_scheduler(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    ids = trial_ids(task["id"])
    update_row(Trial, ids[0], state="completed", steps_done=6)
    update_row(Trial, ids[1], state="running", steps_done=2)
    bus = get_bus()
    tail = bus.tail_id(SCHEDULER_STREAM)

    r = client.post(f"/v1/tasks/{task['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 200
    body = r.json()
    assert body["state"] == "cancelled" and body["finished_at"] is not None
    assert body["trial_counts"]["completed"] == 1 and body["trial_counts"]["cancelled"] == 3
    trials = client.get(f"/v1/tasks/{task['id']}/trials", headers=tenant.headers).json()["data"]
    assert [(t["state"], t["stop_reason"]) for t in trials] == [
        ("completed", None)] + [("cancelled", "task cancelled")] * 3
    assert all(t["finished_at"] for t in trials[1:])
    events = client.get(f"/v1/tasks/{task['id']}/events", headers=tenant.headers).json()["data"]
    assert [e["type"] for e in events] == ["task.created", "task.small_validation", "task.cancelled"]
    messages = [m for _id, m in bus.read_after(SCHEDULER_STREAM, tail, 100, 0.5)]
    assert Wake(reason="task.cancelled", task_id=task["id"]).to_dict() in messages


def test_cancelling_a_finished_task_is_409(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    assert client.post(f"/v1/tasks/{task['id']}/cancel", headers=tenant.headers).status_code == 200
    r = client.post(f"/v1/tasks/{task['id']}/cancel", headers=tenant.headers)
    assert r.status_code == 409
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("conflict_error", "task_finished")

    done = make_task(client, tenant)
    update_row(Task, done["id"], state="succeeded")
    assert client.post(f"/v1/tasks/{done['id']}/cancel", headers=tenant.headers).status_code == 409
