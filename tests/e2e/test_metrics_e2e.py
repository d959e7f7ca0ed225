"""Prometheus metrics of every real process after a real task: `loraplane api --workers 2` (multiprocess mode:
any process's `GET /metrics` is the sum over both), `loraplane scheduler` and `loraplane worker` on their own
metrics ports, the tiny model on the CPU."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import ADMIN_TOKEN
from tests.e2e.flow import arithmetic_rows, grid_task, submit, tenant_client, upload, wait_for
from tests.e2e.procs import cluster, distributed_env, free_port, wait_ready
from tests.prom import Key, samples, value

MODEL = "tiny-random-llama"
TRIALS = 4  # grid_task: 2 learning rates x 2 ranks


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[Key, float]:
    # A fresh connection each time: under SO_REUSEPORT the kernel picks the API process per connection.
    r = httpx.get(url, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return samples(r.text)


@pytest.fixture
def env(clean_db: None, tmp_path: Path) -> dict[str, str]:
    e = distributed_env(tmp_path)
    e.update({
        "LORAPLANE_METRICS_HOST": "127.0.0.1",
        "LORAPLANE_SCHEDULER_METRICS_PORT": str(free_port()),
        "LORAPLANE_WORKER_METRICS_PORT": str(free_port()),
        # `loraplane api` makes its multiprocess directory under TMPDIR: here, where the test can see it go.
        "TMPDIR": str(tmp_path / "tmp"),
    })
    (tmp_path / "tmp").mkdir()
    return e


def test_every_process_exposes_its_metrics(env: dict[str, str], tmp_path: Path) -> None:
    scheduler_url = f"http://127.0.0.1:{env['LORAPLANE_SCHEDULER_METRICS_PORT']}/metrics"
    worker_url = f"http://127.0.0.1:{env['LORAPLANE_WORKER_METRICS_PORT']}/metrics"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with cluster(env, tmp_path) as c:
        api = c.start("api", "api", "--host", "127.0.0.1", "--port", str(port), "--workers", "2")
        c.start("scheduler", "scheduler")
        wait_ready(base_url, [api])
        shared = list((tmp_path / "tmp").glob("loraplane-metrics-*"))
        assert len(shared) == 1 and shared[0].is_dir()

        with tenant_client(base_url, ADMIN_TOKEN, "team-metrics") as lp:
            body = {**grid_task(upload(lp, arithmetic_rows()), max_steps=4), "early_exit": {"policy": "none"}}
            task = submit(lp, body)
            # No worker yet: every trial waits, and the scheduler's gauges say so.
            wait_for(lambda: value(scrape(scheduler_url), "loraplane_scheduler_pending_trials",
                                   base_model=MODEL) == TRIALS, 30, "the pending gauge")
            assert value(scrape(scheduler_url), "loraplane_scheduler_trials", state="pending") == TRIALS

            c.start("worker", "worker", "--worker-id", "metrics-e2e")
            ended = wait_for(lambda: (t := lp.tasks.get(task.id)).done and t, 240, "the task to end")
            assert ended.state == "succeeded", ended

        # The scheduler: it replanned, ingested reports (their lag measured from `sent_at`), and once the next
        # round saw the task done, no trial is pending or running and no pack runs.
        def scheduler_settled() -> dict[Key, float] | None:
            parsed = scrape(scheduler_url)
            idle = (value(parsed, "loraplane_scheduler_trials", state="running") == 0
                    and value(parsed, "loraplane_scheduler_pending_trials", base_model=MODEL) == 0
                    and value(parsed, "loraplane_scheduler_packs_running") == 0)
            return parsed if idle else None

        parsed = wait_for(scheduler_settled, 30, "the scheduler's gauges to settle")
        assert value(parsed, "loraplane_scheduler_replan_seconds_count") >= 1
        assert value(parsed, "loraplane_scheduler_replan_seconds_sum") > 0
        lag = value(parsed, "loraplane_scheduler_ingest_lag_seconds_count")
        assert lag >= 1 and value(parsed, "loraplane_scheduler_messages_ingested_total") >= lag
        assert value(parsed, "loraplane_scheduler_ingest_lag_seconds_bucket", le="+Inf") == lag

        # The worker: every step timed, an adapter per trial, no slot in use once the pack ended.
        parsed = wait_for(lambda: (p := scrape(worker_url)) and value(p, "loraplane_worker_slots_in_use") == 0
                          and value(p, "loraplane_worker_adapters_uploaded_total") == TRIALS and p,
                          30, "the worker's pack to end")
        assert value(parsed, "loraplane_worker_step_seconds_count") >= 4  # max_steps, in one pack
        assert value(parsed, "loraplane_worker_step_seconds_sum") > 0
        assert ("loraplane_worker_tokens_per_second", frozenset()) in parsed
        # Its pack's phases, counted at the pack's end: steps trained, and part of its wall time was outside them.
        assert value(parsed, "loraplane_worker_pack_phase_seconds_total", phase="steps") > 0
        assert 0 < value(parsed, "loraplane_worker_last_pack_outside_steps_ratio") < 1
        gpu_memory = [v for k, v in parsed.items() if k[0] == "loraplane_worker_gpu_memory_allocated_bytes"]
        # On the CPU there is no device memory to read: no sample at all, rather than a false 0.
        assert (gpu_memory and gpu_memory[0] > 0) if torch.cuda.is_available() else not gpu_memory

        # The API: requests on fresh connections reach both processes; every scrape, whichever process answers
        # it, counts all of them.
        before = value(scrape(f"{base_url}/metrics", admin), "loraplane_api_requests_total", route="/healthz",
                       method="GET", status="200")
        for _ in range(20):
            assert httpx.get(f"{base_url}/healthz", timeout=10).status_code == 200
        for _ in range(6):
            parsed = scrape(f"{base_url}/metrics", admin)
            assert value(parsed, "loraplane_api_requests_total", route="/healthz", method="GET",
                         status="200") >= before + 20
            assert value(parsed, "loraplane_api_requests_total", route="/v1/tasks/{task_id}", method="GET",
                         status="200") >= 1  # the client's polls above
        r = httpx.get(f"{base_url}/metrics", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_admin_token"
        api.stop()
        assert not shared[0].exists()  # `loraplane api` removed its multiprocess directory on exit
