"""Hollow workers drive the real control plane (issue 53): `loraplane worker --hollow --count 8` (eight hollow workers
in one process: their real shell, a timing model for the engine, worker/hollow/) against `loraplane api` and
`loraplane scheduler` on the real PostgreSQL and Redis, in distributed mode. Two tenants' tasks run with early exit
and back-fills; the hollow process is killed -9 mid-run and started again (the same worker ids, new incarnations);
both tasks succeed, and every loss point the API serves is there once, with the value the hollow engine replays for
its step."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from common.datasets import parse_jsonl, split_rows
from loraplane.client import Client
from tests.conftest import ADMIN_TOKEN, DATABASE_URL
from tests.e2e.chaos import RESTART_TIMEOUT_S, assert_ended_by_new_process
from tests.e2e.flow import follow_events, submit, task_progress, tenant_client, upload, wait_progressing
from tests.e2e.procs import cluster, distributed_env, start_control_plane
from worker.hollow.curves import data_key, load_library, pick_curve, train_loss, val_loss

COUNT = 8
PREFIX = "hollow-e2e"
SEED = 7
SPLIT = 0.2
MAX_STEPS = 300
EVAL_EVERY = 30
# At 4 model seconds a wall second, a step of a pack of two trials (0.26 s by the GPU prior) sleeps ~65 ms: a trial
# trains its 300 steps in ~20 s, long enough for the kill to land mid-run, short enough for the test to end in
# about two minutes on two cores.
TIME_SCALE = 4


def rows(n: int, offset: int) -> list[dict[str, str]]:
    return [{"prompt": f"{a} plus {a + offset} is", "completion": f" {2 * a + offset}"} for a in range(n)]


def task_body(file_id: str, learning_rates: list[float], ranks: list[int], batches: list[int]) -> dict[str, Any]:
    return {
        "base_model": "tiny-random-llama", "training_file": file_id, "validation_split": SPLIT,
        "search_space": {"learning_rate": learning_rates, "lora_rank": ranks, "batch_size": batches,
                         "target_modules": [["q_proj", "v_proj"]]},
        "strategy": "grid", "max_steps": MAX_STEPS, "max_seq_len": 64, "eval_interval": EVAL_EVERY, "seed": SEED,
        # ALTO: each trial validated at its warm-up boundary (5%), the better half kept; the divergence and
        # overfitting thresholds as the service's defaults.
        "early_exit": {"policy": "alto", "rungs": 1, "keep_ratio": 0.5},
    }


def incarnations() -> dict[str, str]:
    engine = create_engine(DATABASE_URL, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return {str(i): str(n) for i, n in conn.execute(text("SELECT id, incarnation FROM workers"))}
    finally:
        engine.dispose()


def assert_points_replayed(lp: Client, task_id: str, data: list[dict[str, Any]]) -> Counter[str]:
    """Every trial's served points: each step once (train: every step it trained; val: each validation), each value
    the hollow engine's replay of that step (its curve picked from the trial's rows and configuration, as the worker
    picks it). Returns the trials' states."""
    library = load_library()
    train_rows, _ = split_rows(data, SPLIT, SEED)
    states: Counter[str] = Counter()
    trials = {t.id: t for t in lp.tasks.trials(task_id).data}
    for row in lp.tasks.curves(task_id):
        trial, hp, total = trials[row["trial_id"]], row["hyperparameters"], int(row["total_steps"])
        states[trial.state] += 1
        curve = pick_curve(library, data=data_key(train_rows), seed=int(hp["seed"]),
                           learning_rate=float(hp["learning_rate"]), lora_rank=int(hp["lora_rank"]),
                           batch_size=int(hp["batch_size"]))
        train = [(int(p[0]), float(p[3])) for p in row["train"]]
        assert [s for s, _ in train] == list(range(1, trial.steps_done + 1)), (trial.id, trial.state, train[:5])
        assert [v for _, v in train] == pytest.approx([train_loss(curve, s, total) for s, _ in train], rel=1e-12)
        val = [(int(p[0]), float(p[3])) for p in row["val"]]
        steps = [s for s, _ in val]
        assert steps == sorted(set(steps)) and all(0 < s <= trial.steps_done for s in steps), (trial.id, steps)
        assert [v for _, v in val] == pytest.approx([val_loss(curve, s, total) for s in steps], rel=1e-12)
        if trial.state == "completed":
            assert trial.steps_done == total and steps[-1] == total, (trial.id, steps)
    return states


def test_eight_hollow_workers_run_two_tenants_with_early_exit_and_back_fill_through_a_kill(
    clean_db: None, tmp_path: Path
) -> None:
    env = distributed_env(tmp_path)
    # Only the restarted process's first beats (new incarnations under the same ids) may end the killed one's packs.
    env["LORAPLANE_WORKER_TIMEOUT_S"] = str(RESTART_TIMEOUT_S)
    hollow = ("worker", "--hollow", "--count", str(COUNT), "--worker-id", PREFIX, "--slots", "2", "--max-packs", "1",
              "--time-scale", str(TIME_SCALE), "--noise", "0.05")
    data_a, data_b = rows(40, 1), rows(30, 3)
    with cluster(env, tmp_path) as c:
        base_url = start_control_plane(c)
        process = c.start("hollow", *hollow)
        a = tenant_client(base_url, ADMIN_TOKEN, "hollow-a")
        b = tenant_client(base_url, ADMIN_TOKEN, "hollow-b")
        # 16 + 8 trials on 8 workers of 2 slots: some wait, and join packs as the early exit frees their slots.
        a_task = submit(a, task_body(upload(a, _jsonl(data_a)), [1e-4, 3e-4, 1e-3, 3e-3], [4, 16], [4, 8])).id
        b_task = submit(b, task_body(upload(b, _jsonl(data_b)), [1e-4, 1e-3, 3e-3, 1e-2], [4, 16], [4])).id

        def progress() -> object:
            return task_progress(a, a_task), task_progress(b, b_task)

        def mid_run() -> bool:
            trials = [*a.tasks.trials(a_task).data, *b.tasks.trials(b_task).data]
            return sum((t.checkpoint_step or 0) > 0 and t.state == "running" for t in trials) >= COUNT

        wait_progressing(mid_run, progress, "trials training on every hollow worker, checkpointed", interval_s=0.3)
        before = incarnations()
        assert sorted(before) == [f"{PREFIX}-{i}" for i in range(COUNT)], before
        killed_at = datetime.now(UTC)
        process.kill()
        c.start("hollow-2", *hollow)

        requeued = []
        for lp, task_id, data in ((a, a_task, data_a), (b, b_task, data_b)):
            events, ended = follow_events(lp, task_id)
            story = "\n".join(f"  {e.type} {e.trial_id or ''} {e.data}" for e in events)
            assert ended.state == "succeeded", f"{ended.state} {ended.error}\n{story}"
            kinds = Counter(e.type for e in events)
            assert kinds["trial.stopped_early"] >= 1, story
            assert any(e.type == "trial.running" and e.data.get("backfill") for e in events), story
            requeued += [e for e in events if e.type == "trial.requeued" and e.data["blame"] == "worker"]
            states = assert_points_replayed(lp, task_id, data)
            assert set(states) <= {"completed", "stopped_early"} and states["completed"] >= 1, states
            # The kill spent no attempt (a trial paused at its warm-up boundary and stopped there has spent none).
            again = [t.id for t in lp.tasks.trials(task_id).data if t.attempts > 1]
            assert not again, "\n".join(f"  {e.type} {e.trial_id} {e.data}" for e in events if e.trial_id in again)
        assert requeued and all(int(e.data["resume_step"]) > 0 for e in requeued)  # resumed from checkpoints
        assert_ended_by_new_process(requeued, killed_at)

        after = incarnations()
        assert sorted(after) == sorted(before) and all(after[w] != before[w] for w in before), (before, after)
        workers = a.admin.list_workers().data
        assert {(w.id, w.state, w.device) for w in workers} == {
            (f"{PREFIX}-{i}", "alive", "hollow:H200") for i in range(COUNT)}
        adapter = a.tasks.download_adapter(a_task, tmp_path / "adapter")
        # The best adapter is a hollow one: marked, no weights.
        assert sorted(p.name for p in adapter.iterdir()) == ["HOLLOW.md", "adapter_config.json"]
        assert json.loads((adapter / "adapter_config.json").read_text())["loraplane_hollow"] is True
        a.close()
        b.close()


def _jsonl(data: list[dict[str, Any]]) -> bytes:
    assert parse_jsonl("\n".join(json.dumps(r) for r in data).encode()) == data
    return "\n".join(json.dumps(r) for r in data).encode() + b"\n"
