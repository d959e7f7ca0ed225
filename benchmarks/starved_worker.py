"""A CPU-starved worker keeps its heartbeat (issue 32): `loraplane up` trains a long task on the CPU while a busy
loop runs on every core (twice over), for ten minutes by default; the worker must never be declared lost, no trial
requeued, and the task's usage must count its pack once.

    python -m benchmarks.starved_worker [--seconds 600]

Before issue 32 the heartbeat was a thread of the training process and the only worker of `make up` was declared
lost on a busy CPU (`worker local lost (no heartbeat for 30s)`), its pack run twice and billed twice. The worker
timeout here is the default (`LORAPLANE_WORKER_TIMEOUT_S`, 30 s), as a user of `make up` has it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import write_result
from tests.e2e.procs import cluster, free_port, wait_ready

ADMIN_TOKEN = "starved-worker-admin"
EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE",
                  "LORAPLANE_WORKER_TIMEOUT_S")
ROWS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
        for a in range(1, 11) for b in range(1, 6)]


def tenant_key(api: httpx.Client) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    tenant = api.post("/v1/admin/tenants", headers=admin, json={"name": "starved"}).json()
    return str(api.post(f"/v1/admin/tenants/{tenant['id']}/api-keys", headers=admin,
                        json={"name": "bench"}).json()["key"])


def submit(api: httpx.Client, key: str) -> str:
    """A task that trains for longer than the run: four trials of the tiny model, many steps."""
    auth = {"Authorization": f"Bearer {key}"}
    body = "\n".join(json.dumps(r) for r in ROWS).encode()
    file_id = api.post("/v1/files", headers=auth, files={"file": ("rows.jsonl", body)}).json()["id"]
    task = api.post("/v1/tasks", headers=auth, json={
        "base_model": "tiny-random-llama", "training_file": file_id, "validation_split": 0.2,
        "search_space": {"learning_rate": [1e-3, 3e-3], "lora_rank": [4, 8]}, "max_steps": 200_000,
        "max_seq_len": 128}).json()
    return str(task["id"])


def watch(api: httpx.Client, key: str, task_id: str, seconds: float) -> dict[str, Any]:
    """Poll the worker's state and the task's events once a second for `seconds`."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    auth = {"Authorization": f"Bearer {key}"}
    samples, not_alive, steps = 0, 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        workers = api.get("/v1/admin/workers", headers=admin).json()["data"]
        samples += 1
        not_alive += sum(1 for w in workers if w["state"] != "alive")
        trials = api.get(f"/v1/tasks/{task_id}/trials", headers=auth).json()["data"]
        steps = sum(t["steps_done"] for t in trials)
        time.sleep(1.0)
    events = api.get(f"/v1/tasks/{task_id}/events", headers=auth, params={"limit": 1000}).json()["data"]
    kinds = [e["type"] for e in events]
    return {"samples": samples, "samples_worker_not_alive": not_alive, "steps_trained": steps,
            "trials_requeued": kinds.count("trial.requeued"),
            "events_saying_lost": sum("lost" in e["message"] for e in events)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the cores stay busy")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="starved-"))
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp / "home"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp) as c, httpx.Client(base_url=base_url, timeout=60) as api:
        up = c.start("up", "up", "--port", str(port))
        wait_ready(base_url, [up])
        key = tenant_key(api)
        task_id = submit(api, key)
        busy_loops = 2 * (os.cpu_count() or 1)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_loops)]
        try:
            result = watch(api, key, task_id, args.seconds)
        finally:
            for burner in burners:
                burner.kill()
        api.post(f"/v1/tasks/{task_id}/cancel", headers={"Authorization": f"Bearer {key}"})
    result.update({"seconds": args.seconds, "busy_loops": busy_loops})
    write_result("starved_worker", list(result), [list(result.values())], {})


if __name__ == "__main__":
    main()
