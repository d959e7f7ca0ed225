"""A newcomer's first minutes (issue 32): `loraplane up` prints one box, last, once the API answers and its worker
takes packs (the admin token inside), with no access-log line per request unless asked for; and the example task
of `examples/` runs as the README gives it, through the real CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.flow import follow_events, tenant_client, wait_for
from tests.e2e.procs import ROOT, START_CEILING_S, cluster, free_port, wait_ready

EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ADMIN_TOKEN",
                  "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE", "LORAPLANE_ACCESS_LOG")
# The frame `loraplane up` prints: a rule, lines between bars, a rule.
BOX = re.compile(r"^\+-+\+\n(?:\|.*\|\n)+\+-+\+\n", re.MULTILINE)
ACCESS_LINE = re.compile(r'"(?:GET|POST|DELETE) /')


def embedded_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_SCHEDULER_TICK_S": "0.5",
                "LORAPLANE_HEARTBEAT_S": "1"})
    return env


def test_up_prints_its_box_last_and_the_example_task_succeeds(tmp_path: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(embedded_env(tmp_path), tmp_path) as c:
        up = c.start("up", "up", "--port", str(port), "--worker-id", "starter")
        box = wait_for(lambda: BOX.search(up.log_path.read_text()), START_CEILING_S, "the box `up` prints").group(0)
        log = up.log_path.read_text()
        before, after = log[: log.index(box)], log[log.index(box) + len(box):]
        # Last of start-up: the migrations, the scheduler and the worker said their lines above it (a line of the
        # worker's heartbeat process may come after it, as may a request's; no start-up line does).
        for line in ("database schema", "scheduler running", "worker starter (incarnation"):
            assert line in before and line not in after, log
        assert "Uvicorn running" not in log
        assert httpx.get(f"{base_url}/healthz").status_code == 200
        token = re.search(r"^\|\s+(lpadmin_\S+)\s+\|$", box, re.MULTILINE)
        assert token, box
        assert f"http://127.0.0.1:{port}" in box and str(tmp_path / "home") in box
        # Quiet: one line for the migrations (none of Alembic's per revision), no Celery banner.
        assert "Running upgrade" not in log and "[queues]" not in log
        assert len(re.findall(r"database schema", log)) == 1, log

        with tenant_client(base_url, token.group(1), "newcomer") as lp:
            env = {**os.environ, "LORAPLANE_API_URL": base_url, "LORAPLANE_API_KEY": lp.api_key or ""}
            created = subprocess.run([sys.executable, "-m", "loraplane.cli", "tasks", "create", "examples/task.yaml",
                                      "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            assert created.returncode == 0, created.stderr
            task_id = json.loads(created.stdout)["id"]
            events, ended = follow_events(lp, task_id)
            assert ended.state == "succeeded", [(e.type, e.message) for e in events]
            trials = lp.tasks.trials(task_id).data
            assert len(trials) == 4 and all(t.state == "completed" for t in trials)
            # Created again: the same chat.jsonl is not uploaded a second time.
            again = subprocess.run([sys.executable, "-m", "loraplane.cli", "tasks", "create", "examples/task.yaml",
                                    "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            assert again.returncode == 0, again.stderr
            assert json.loads(again.stdout)["training_file"] == json.loads(created.stdout)["training_file"]
            assert "uploaded chat.jsonl as" in created.stderr, created.stderr
            assert "uploaded chat.jsonl as" not in again.stderr and "reusing" in again.stderr, again.stderr
            assert len(lp.files.list().data) == 1
            lp.tasks.cancel(json.loads(again.stdout)["id"])
        # Hundreds of requests were answered (the CLI's, the client's polls): not one access-log line.
        assert not ACCESS_LINE.search(up.log_path.read_text())


def test_access_log_is_on_when_asked_for(tmp_path: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(embedded_env(tmp_path), tmp_path) as c:
        quiet = c.start("quiet", "api", "--host", "127.0.0.1", "--port", str(port))
        wait_ready(base_url, [quiet])
        assert httpx.get(f"{base_url}/healthz").status_code == 200
        quiet.stop()
        assert not ACCESS_LINE.search(quiet.log_path.read_text())
        loud = c.start("loud", "api", "--host", "127.0.0.1", "--port", str(port), "--access-log")
        wait_ready(base_url, [loud])
        assert httpx.get(f"{base_url}/healthz").status_code == 200
        wait_for(lambda: '"GET /healthz' in loud.log_path.read_text(), START_CEILING_S, "the access-log line")


def test_make_up_takes_host_and_port() -> None:
    """`make up PORT=... HOST=...` reaches `loraplane up` (printed by make -n, not run)."""
    shown = subprocess.run(["make", "-n", "up", "PORT=8123", "HOST=0.0.0.0"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "loraplane up --host 0.0.0.0 --port 8123" in shown.stdout, shown.stdout
    default = subprocess.run(["make", "-n", "up"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "loraplane up --host 127.0.0.1 --port 8000" in default.stdout, default.stdout
