"""The embedded default end to end: `loraplane up` alone (SQLite, file-backed bus and Celery broker,
local artifacts, a supervised CPU worker), with no DATABASE_URL, REDIS_URL or admin token given."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from common.datasets import validation_rows
from common.task_spec import refit_steps
from tests.conftest import MODEL_CACHE
from tests.e2e.flow import (
    arithmetic_rows,
    assert_adapter_changes_output,
    download_adapter,
    follow_events,
    grid_task,
    submit,
    tenant_client,
    upload,
    wait_for,
)
from tests.e2e.procs import EMBEDDED_UNSET, ROOT, cluster, free_port, start_embedded


def test_loraplane_up_runs_a_grid_task_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    home = tmp_path / "home"
    env.update({"LORAPLANE_HOME": str(home), "LORAPLANE_SCHEDULER_TICK_S": "0.5", "LORAPLANE_HEARTBEAT_S": "1"})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp_path) as c:
        up, token = start_embedded(c, port)
        with tenant_client(base_url, token, "team-embedded") as lp:
            file_id = upload(lp, arithmetic_rows())
            # With a refit (issue 33): once the grid's winner is known, its configuration trains again on the
            # training and validation rows together, as a fifth trial with an adapter of its own.
            task = submit(lp, {**grid_task(file_id), "refit": True})
            events, ended = follow_events(lp, task.id)
            assert ended.state == "succeeded", [e.type for e in events]
            types = [e.type for e in events]
            assert types.count("trial.completed") == 5 and types.index("task.refit_started") < types.index(
                "task.succeeded")
            trials = lp.tasks.trials(task.id).data
            assert all(t.state == "completed" and t.adapter_ready for t in trials)
            (refit,) = [t for t in trials if t.refit_of]
            winner = next(t for t in trials if t.id == ended.best_trial.id)  # type: ignore[union-attr]
            assert ended.refit_trial_id == refit.id and refit.refit_of == winner.id
            assert refit.hyperparameters == winner.hyperparameters and refit.best_val_loss is None
            # 32 rows, 0.2 held out (common.datasets.validation_rows): its steps cover all 32 as the winner's
            # adapter covered the training rows.
            held_out = validation_rows(32, 0.2)
            assert refit.total_steps == refit.steps_done == refit_steps(winner.best_step, 32 - held_out, held_out)
            adapter = download_adapter(lp, task.id, tmp_path / "adapter", trial_id=trials[0].id)
            refitted = lp.tasks.download_adapter(task.id, tmp_path / "refit", refit=True)
            usage = httpx.get(f"{base_url}/v1/usage", headers={"Authorization": f"Bearer {lp.api_key}"}).json()
        assert_adapter_changes_output(adapter, "tiny-random-llama", MODEL_CACHE)
        assert_adapter_changes_output(refitted, "tiny-random-llama", MODEL_CACHE)
        # Usage (issue 18) is the packs' recorded time, all of it, and the tokens the worker reported training.
        with sqlite3.connect(home / "loraplane.db") as db:
            packs = db.execute("SELECT started_at, finished_at FROM packs WHERE started_at IS NOT NULL").fetchall()
            tokens, steps = db.execute("SELECT SUM(tokens), SUM(steps) FROM trial_usage").fetchone()
        pack_s = sum((datetime.fromisoformat(f) - datetime.fromisoformat(s)).total_seconds() for s, f in packs)
        assert packs and usage["gpu_seconds"] == pytest.approx(pack_s, abs=1e-3), (usage, packs)
        # 4 trials x 6 steps and the refit's, of 4 rows of at most 64 tokens
        all_steps = 4 * 6 + refit.total_steps
        assert usage["tokens"] == tokens and 0 < tokens <= all_steps * 4 * 64 and steps == all_steps, usage
        assert usage["trials"] == {"completed": 5}

        # `loraplane up` killed outright: its worker child must not live on as an orphan.
        children = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(up.proc.pid)],
                                                   capture_output=True, text=True).stdout.split()]
        assert children, "the embedded worker should be a child of `loraplane up`"
        os.kill(up.proc.pid, signal.SIGKILL)
        wait_for(lambda: not any(running(pid) for pid in children), 30, "the worker to exit with its parent")
    # Everything lived in files under LORAPLANE_HOME: no server was used.
    assert (home / "loraplane.db").is_file() and (home / "bus.db").is_file()
    assert list((home / "artifacts" / "adapters").glob("*/*.tar.gz"))
    assert (home / "broker" / "control").is_dir() and not (ROOT / "control").exists()


def running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited already
