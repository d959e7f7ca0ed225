"""Chaos: routine faults injected into real processes mid-task (issue 14), embedded (`loraplane up`; the
distributed ones: tests/e2e/test_chaos_distributed.py, split so that the two test processes share them).

Each scenario runs a long task of tenant A (two trials) and one of tenant B (one trial) on `tiny-random-llama`,
checkpointing every 0.2 s (LORAPLANE_CHECKPOINT_INTERVAL_S) and validating every 20 steps. Once every trial has
reported a checkpoint, the fault: the worker killed and back at once under the same id, `up`
killed and restarted, Redis restarted empty, the database stopped for 20 s (and the worker killed while it runs two
packs, B's on a second model beside A's). Then both tasks must succeed,
every trial that was interrupted must resume from its checkpoint (not from step 0), and every trial's train
curve must hold each step exactly once. A worker's crash is never the trials' fault: every trial ends at attempt 1
however often its worker died (issue 29), and a worker that keeps dying is quarantined, then recovers. The
distributed outage tests run on a Redis or a PostgreSQL of their own, never on the shared ones.

Every wait on the run is a wait on progress (tests/e2e/flow.py `wait_progressing`): it fails only when nothing
moved for a long while, so the tests pass on two cores busy with other jobs, only slower.
"""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from loraplane.client import Client
from tests.conftest import ADMIN_TOKEN
from tests.e2e.chaos import (
    CHAOS_ENV,
    EMBEDDED_UNSET,
    RESTART_TIMEOUT_S,
    assert_ended_by_new_process,
    assert_recovered,
    checkpoints_before_fault,
    start_up,
    submit_both,
    worker_child,
)
from tests.e2e.flow import (
    wait_for,
)
from tests.e2e.procs import (
    START_CEILING_S,
    child_pids,
    cluster,
    free_port,
    is_worker,
    running,
    wait_ready,
    workers_of_home,
)
from tests.model_dirs import tiny_model_dir


@pytest.fixture
def embedded_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update(CHAOS_ENV)
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN})
    return env



def test_embedded_worker_killed_comes_back_under_its_id(embedded_env: dict[str, str], tmp_path: Path) -> None:
    """E1: kill -9 `up`'s worker child; the supervisor starts a new one as `local`, whose first heartbeat
    ends the dead one's pack at once."""
    embedded_env["LORAPLANE_WORKER_TIMEOUT_S"] = str(RESTART_TIMEOUT_S)
    port = free_port()
    with cluster(embedded_env, tmp_path) as c:
        up = start_up(c, "up", port)
        tasks = submit_both(f"http://127.0.0.1:{port}", ADMIN_TOKEN)
        checkpoints = checkpoints_before_fault(tasks)
        old = worker_child(up)
        killed_at = datetime.now(UTC)
        os.kill(old, signal.SIGKILL)
        new = wait_for(lambda: next((p for p in child_pids(up.proc.pid) if is_worker(p) and p != old), None),
                       START_CEILING_S, "the supervisor to restart the worker")
        assert not running(old) and running(new)
        assert_ended_by_new_process(assert_recovered(tasks, checkpoints, requeues=1), killed_at)
        workers = {w.id: w for w in tasks.a.admin.list_workers()}
        assert set(workers) == {"local"} and workers["local"].state == "alive", workers
        tasks.close()


def test_embedded_worker_killed_while_it_runs_two_packs_of_two_models(embedded_env: dict[str, str],
                                                                      tmp_path: Path) -> None:
    """E1 with B's task on a second registered model: the worker runs A's pack and B's at once (issue 34,
    worker/colocation.py) when it is killed -9; the new process's first heartbeat ends both, and both tasks resume
    from their checkpoints on it, each step once."""
    embedded_env.update({"LORAPLANE_WORKER_TIMEOUT_S": str(RESTART_TIMEOUT_S), "LORAPLANE_WORKER_MAX_PACKS": "2"})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(embedded_env, tmp_path) as c:
        up = start_up(c, "up", port)
        with Client(base_url, admin_token=ADMIN_TOKEN, timeout=30) as operator:
            operator.admin.register_model("tiny-qwen2", str(tiny_model_dir("qwen2", tmp_path / "tiny-qwen2")))
        tasks = submit_both(base_url, ADMIN_TOKEN, b_model="tiny-qwen2")
        checkpoints = checkpoints_before_fault(tasks)
        live = httpx.get(f"{base_url}/v1/admin/packs", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        assert sorted((p["worker_id"], p["base_model"], p["state"]) for p in live["data"]) == [
            ("local", "tiny-qwen2", "running"), ("local", "tiny-random-llama", "running")], live
        old = worker_child(up)
        killed_at = datetime.now(UTC)
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: next((p for p in child_pids(up.proc.pid) if is_worker(p) and p != old), None),
                 START_CEILING_S, "the supervisor to restart the worker")
        assert_ended_by_new_process(assert_recovered(tasks, checkpoints, requeues=1), killed_at)
        tasks.close()


def test_embedded_up_killed_and_restarted_at_once(embedded_env: dict[str, str], tmp_path: Path) -> None:
    """E2: kill -9 `up` alone (not its process group): its worker child dies with it instead of training on
    as an orphan; `up` started again at once on the same home and port finishes both tasks."""
    port = free_port()
    home = Path(embedded_env["LORAPLANE_HOME"])
    with cluster(embedded_env, tmp_path) as c:
        up = start_up(c, "up", port)
        tasks = submit_both(f"http://127.0.0.1:{port}", ADMIN_TOKEN)
        checkpoints = checkpoints_before_fault(tasks)
        old_worker = worker_child(up)
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(timeout=10)
        up_2 = c.start("up-2", "up", "--port", str(port))
        wait_for(lambda: not running(old_worker), START_CEILING_S, f"the worker child {old_worker} to die with `up`")
        wait_ready(f"http://127.0.0.1:{port}", [up_2])
        new_worker = worker_child(up_2)
        assert workers_of_home(home) == [new_worker], "one worker per home: the old one must not live on"
        assert (home / "loraplane.db").is_file()
        assert_recovered(tasks, checkpoints, requeues=1)
        tasks.close()


# ------------------------------------------------------------------------------------------- distributed
