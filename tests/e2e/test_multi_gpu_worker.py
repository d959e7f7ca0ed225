"""A worker over several GPUs (`loraplane worker --gpus 0,1`, worker/rank_pool.py) end to end, with its two ranks on the
CPU (gloo): the real API, scheduler and Celery worker processes against the real PostgreSQL and Redis.

A pack on it runs over both ranks, its base's layers sharded and its trials dealt to the ranks; a back-fill goes to
a rank with room, a cancel stops the trials on both. Each trial's adapter comes out as the same trial's on a worker
on one device, to 1e-5. A rank killed mid-pack ends the worker; started again under its id, it resumes the trials
from their checkpoints."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from loraplane.client import Client
from tests.conftest import ADMIN_TOKEN
from tests.e2e.flow import (
    arithmetic_rows,
    download_adapter,
    follow_events,
    grid_task,
    submit,
    tenant_client,
    upload,
    wait_for,
)
from tests.e2e.procs import Cluster, child_pids, cluster, cmdline, distributed_env, start_control_plane

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available in this torch build")


@pytest.fixture
def services(clean_db: None, tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    env = distributed_env(tmp_path)
    env["LORAPLANE_WORKER_CPU_THREADS"] = "1"  # two ranks on a CI machine's two cores
    env["LORAPLANE_WORKER_RANK_TIMEOUT_S"] = "120"
    with cluster(env, tmp_path) as c:
        yield c, start_control_plane(c)


def short_task(file_id: str) -> dict[str, Any]:
    """Two trials of different shapes, with dropout: their adapters depend on every detail of their math."""
    body = grid_task(file_id, max_steps=8)
    body["search_space"] = {"learning_rate": [2e-3], "lora_rank": [2, 4], "batch_size": [2], "lora_dropout": [0.1],
                            "target_modules": [["q_proj", "v_proj"]]}
    return body


def adapters(lp: Client, task_id: str, into: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Each trial's adapter, by its LoRA rank (the one hyperparameter that differs)."""
    out = {}
    for t in lp.tasks.trials(task_id):
        folder = download_adapter(lp, task_id, into / t.id, trial_id=t.id)
        out[int(t.hyperparameters["lora_rank"])] = load_file(str(folder / "adapter_model.safetensors"))
    return out


def test_a_pack_over_two_ranks_back_fills_cancels_and_trains_as_one_device(services: tuple[Cluster, str],
                                                                           tmp_path: Path) -> None:
    c, base_url = services
    two = c.start("worker-two", "worker", "--gpus", "0,1", "--worker-id", "e2e-two")
    with tenant_client(base_url, ADMIN_TOKEN, "team-two-ranks") as lp:
        file_id = upload(lp, arithmetic_rows())
        # A long task of two trials, one a rank, in a pack with room for four (two a rank).
        long_body = grid_task(file_id, max_steps=5000)
        long_body["search_space"]["lora_rank"] = [4]
        long_body["scheduling"] = {"max_trials_per_pack": 4}
        long_id = submit(lp, long_body).id
        wait_for(lambda: all(t.steps_done >= 3 for t in lp.tasks.trials(long_id)), 180, "the long task to train")
        (worker,) = [w for w in lp.admin.list_workers() if w.id == "e2e-two"]
        assert worker.gpus == 2 and worker.device == "cpu,cpu", worker

        # A short task back-fills the running pack: rank 0 deals its two trials, one to each rank's free slot.
        short_id = submit(lp, short_task(file_id)).id
        events, ended = follow_events(lp, short_id)
        assert ended.state == "succeeded", [e.type for e in events]
        running = [e for e in events if e.type == "trial.running"]
        assert len(running) == 2 and all(e.data["backfill"] for e in running), running
        long_packs = {e.data["pack_id"] for e in lp.tasks.events(long_id).data if e.type == "trial.running"}
        assert long_packs == {e.data["pack_id"] for e in running}
        on_two = adapters(lp, short_id, tmp_path / "two")

        # A cancel stops the long task's trials on both ranks; the pack ends and the worker is free again.
        assert lp.tasks.cancel(long_id).state == "cancelled"
        wait_for(lambda: next(w for w in lp.admin.list_workers() if w.id == "e2e-two").current_pack_id is None,
                 60, "the two-rank pack to end")
        two.stop()

        c.start("worker-one", "worker", "--worker-id", "e2e-one")
        alone_id = submit(lp, short_task(file_id)).id
        assert follow_events(lp, alone_id)[1].state == "succeeded"
        on_one = adapters(lp, alone_id, tmp_path / "one")
    assert on_two.keys() == on_one.keys() == {2, 4}
    for rank, weights in on_one.items():
        assert weights.keys() == on_two[rank].keys()
        for key, tensor in weights.items():
            torch.testing.assert_close(on_two[rank][key], tensor, rtol=1e-5, atol=1e-6)
    log = two.log_path.read_text()
    assert "rank 1 of worker e2e-two on cpu" in log, log[-3000:]


def _rank_processes(worker_pid: int) -> list[int]:
    """The worker's spawned children that run torch: its ranks (its heartbeat process, spawned too, imports none)."""
    return [pid for pid in child_pids(worker_pid) if any("spawn_main" in part for part in cmdline(pid))
            and _loads_torch(pid)]


def _loads_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # it ended meanwhile
        return False


def test_a_killed_rank_ends_its_worker_and_the_restarted_worker_resumes_the_trials(
        services: tuple[Cluster, str]) -> None:
    c, base_url = services
    first = c.start("worker-two", "worker", "--gpus", "0,1", "--worker-id", "e2e-rank-kill")
    with tenant_client(base_url, ADMIN_TOKEN, "team-rank-kill") as lp:
        file_id = upload(lp, arithmetic_rows())
        # Long enough to still train when the rank is killed (at the first checkpoint past step 20): the steps after
        # the restart are most of the test's time.
        body = grid_task(file_id, max_steps=160)
        body["eval_interval"] = 20  # the ranks checkpoint their trials every 0.2 s (procs.py distributed_env)
        task_id = submit(lp, body).id
        wait_for(lambda: all((t.checkpoint_step or 0) >= 20 for t in lp.tasks.trials(task_id)), 240,
                 "a checkpoint of every trial", interval_s=0.2)
        (rank1,) = _rank_processes(first.proc.pid)
        os.kill(rank1, signal.SIGKILL)  # a rank that crashed (out of memory, a driver fault)
        deadline = time.monotonic() + 30
        while first.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not first.alive(), "the worker outlived its rank"
        assert "ended; the worker ends with it" in first.log_path.read_text()

        c.start("worker-two-again", "worker", "--gpus", "0,1", "--worker-id", "e2e-rank-kill")
        events, ended = follow_events(lp, task_id)
        assert ended.state == "succeeded", [e.type for e in events]
        requeued = [e for e in events if e.type == "trial.requeued"]
        assert len(requeued) == 4 and all(e.data["resume_step"] >= 20 for e in requeued), requeued
        trials = lp.tasks.trials(task_id).data
        # The rank's death was the worker's loss: no attempt of theirs spent (scheduler/service/faults.py).
        assert all(t.state == "completed" and t.steps_done == 160 and t.attempts == 1 for t in trials)
        for trial in trials:  # one point per step: nothing lost, nothing stored twice around the resume
            assert [p.step for p in lp.tasks.metrics(task_id, trial.id).train] == list(range(1, 161))

