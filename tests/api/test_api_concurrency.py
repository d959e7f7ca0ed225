"""Concurrent requests keep the rules that sequential ones keep; the API image stays torch-free."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi.testclient import TestClient

from common.tables import Task, Trial
from tests.factories import TenantKey, count_rows, make_tenant, task_body, upload

ROOT = Path(__file__).resolve().parents[2]


def test_concurrent_requests_with_one_idempotency_key_make_one_task(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    headers = {**tenant.headers, "Idempotency-Key": "same"}

    def submit(_: int) -> tuple[int, str]:
        r = client.post("/v1/tasks", headers=headers, json=task_body(file["id"]))
        return r.status_code, r.json().get("id", r.text)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(submit, range(6)))
    assert sorted(code for code, _ in results) == [200] * 5 + [201]
    assert len({task_id for _, task_id in results}) == 1
    assert (count_rows(Task), count_rows(Trial)) == (1, 4)


def test_concurrent_tasks_cannot_overrun_the_concurrency_quota(client: TestClient) -> None:
    small = make_tenant(client, max_concurrent_trials=6)
    file = upload(client, small)

    def submit(_: int) -> int:
        return client.post("/v1/tasks", headers=small.headers, json=task_body(file["id"])).status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(submit, range(4)))
    assert sorted(codes) == [201, 429, 429, 429]
    assert count_rows(Trial) == 4


# The scheduler's modules the API may import for its estimates (api/services/estimates.py): the pure cost model and
# planner arithmetic, the reasons a task waits, and the reads of the cluster they share with the daemon. Not the
# solver, the bus or dispatch.
API_SCHEDULER_MODULES = {
    "scheduler", "scheduler.service", "scheduler.service.cluster_state", "scheduler.planning",
    "scheduler.planning.cost", "scheduler.planning.types", "scheduler.planning.coefficients",
    "scheduler.planning.rules", "scheduler.planning.greedy", "scheduler.planning.estimate",
    "scheduler.planning.waits",  # the reasons a task waits (pure): the task's `waiting` field names them
    "scheduler.planning.fairness",  # preemption's window (pure): the cluster view's GPU time per tenant
}


def test_api_imports_no_torch_worker_scheduler_or_kernels() -> None:
    code = (
        "import sys, api.main\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'transformers', 'triton', 'worker', 'kernels', 'ortools'} "
        f"or m.startswith('scheduler') and m not in {API_SCHEDULER_MODULES!r})\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
