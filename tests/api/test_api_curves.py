"""GET /v1/tasks/{id}/curves: every trial's curves as the JSONL `loraplane replay` reads."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from fastapi.testclient import TestClient

from common.db import session_scope
from common.tables import MetricPoint
from scheduler.early_exit.config import EarlyExitConfig
from scheduler.early_exit.policy import curves_from_losses
from scheduler.sim.replay import parse_rows, replay
from tests.factories import TenantKey, make_task, trial_ids


def add_points(trial_id: str, train: list[tuple[int, float]], val: list[tuple[int, float]],
               metric: Sequence[tuple[int, float]] = ()) -> None:
    with session_scope() as session:
        for split, points in (("train", train), ("val", val), ("metric", metric)):
            for step, loss in points:
                session.add(MetricPoint(trial_id=trial_id, step=step, split=split, loss=loss))


def test_curves_are_one_row_per_trial_with_samples_and_tokens_seen(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, search_space={"learning_rate": [1e-4, 3e-4], "batch_size": [2, 8]},
                     max_seq_len=128)
    ids = trial_ids(task["id"])
    add_points(ids[0], [(3, 2.5), (1, 3.0), (2, float("nan"))], [(2, 2.75)])  # stored out of order
    r = client.get(f"/v1/tasks/{task['id']}/curves", headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert r.headers["content-disposition"] == f'attachment; filename="{task["id"]}-curves.jsonl"'
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert [row["trial_id"] for row in rows] == ids and [row["index"] for row in rows] == [0, 1, 2, 3]
    first = rows[0]
    batch = first["hyperparameters"]["batch_size"]
    assert (first["samples_per_step"], first["tokens_per_step"]) == (batch, batch * 128)
    assert first["total_steps"] > 0 and first["state"] == "pending" and first["task_id"] == task["id"]
    assert first["train"] == [[1, batch, batch * 128, 3.0], [2, 2 * batch, 2 * batch * 128, None],
                              [3, 3 * batch, 3 * batch * 128, 2.5]]
    assert first["val"] == [[2, 2 * batch, 2 * batch * 128, 2.75]]
    assert first["metric"] == []
    assert rows[1]["train"] == rows[1]["val"] == rows[1]["metric"] == []
    assert {row["samples_per_step"] for row in rows} == {2, 8}


def test_exported_curves_replay(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant, max_steps=10, epochs=None)  # 4 trials of batch 4; a full curve each
    curves = {}
    for i, trial_id in enumerate(trial_ids(task["id"])):
        curves[trial_id] = ([(s, 3.0 + i - s / 100) for s in range(1, 11)], [(5, 3.0 + i), (10, 2.9 + i)])
        add_points(trial_id, *curves[trial_id], metric=[(10, 0.5 - i / 10)])
    body = client.get(f"/v1/tasks/{task['id']}/curves", headers=tenant.headers).text
    assert json.loads(body.splitlines()[0])["metric"] == [[10, 40, 40 * 512, 0.5]]  # replay ignores it
    sweep = parse_rows(body.splitlines())
    assert len(sweep) == 4 and sweep[0].curves.val[0].samples == 20 and sweep[0].curves.total_steps == 10
    # The scheduler builds the same curves from the same stored points (batch 4, max_seq_len 512).
    for trial in sweep:
        train, val = curves[trial.curves.trial_id]
        assert trial.curves == curves_from_losses(trial.curves.trial_id, "running", 10, 4, 4 * 512, train, val)
    result = replay(EarlyExitConfig(policy="none"), sweep)
    assert result.best_trial == sweep[0].curves.trial_id
    assert result.best_val_ratio == 1.0 and math.isclose(result.spearman_warmup or 0, 1.0)


def test_curves_of_another_tenants_task_are_404(client: TestClient, tenant: TenantKey,
                                                 other_tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    r = client.get(f"/v1/tasks/{task['id']}/curves", headers=other_tenant.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "task_not_found")
    assert task["id"] not in r.text.replace(f"'{task['id']}'", "")  # only the id the caller sent


def test_curves_after_a_step_keep_every_trial_and_only_newer_points(client: TestClient, tenant: TenantKey) -> None:
    """What a live view asks for: the points past the last step it has (every trial still has its line)."""
    task = make_task(client, tenant)
    ids = trial_ids(task["id"])
    add_points(ids[0], [(1, 3.0), (2, 2.9), (3, 2.8)], [(2, 2.95)])
    add_points(ids[1], [(1, 3.1)], [])
    r = client.get(f"/v1/tasks/{task['id']}/curves?after_step=1", headers=tenant.headers)
    assert r.status_code == 200, r.text
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert [row["trial_id"] for row in rows] == ids
    assert [p[0] for p in rows[0]["train"]] == [2, 3] and [p[0] for p in rows[0]["val"]] == [2]
    assert rows[1]["train"] == [] and rows[1]["val"] == []
    r = client.get(f"/v1/tasks/{task['id']}/curves?after_step=-1", headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["param"]) == (422, "after_step")
