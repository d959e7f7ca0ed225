"""Preemption through a real `loraplane up` (issue 34): one worker, tenant A's long trial training alone, tenant B's
short task arriving behind it. A's pack is paused after its slice, B's task trains and succeeds while A waits, and
A's trial resumes from the checkpoint it took as it paused: every training step's point recorded exactly once."""

from __future__ import annotations

import os
from pathlib import Path

from loraplane.client import Client
from loraplane.client.objects import Event
from tests.e2e.flow import (
    arithmetic_rows,
    follow_events,
    submit,
    task_progress,
    tenant_client,
    upload,
    wait_progressing,
)
from tests.e2e.procs import cluster, free_port, start_embedded
from tests.e2e.test_embedded import EMBEDDED_UNSET

SLICE_S = 3


def all_events(lp: Client, task_id: str) -> list[Event]:
    events: list[Event] = []
    after = None
    while True:
        page = lp.tasks.events(task_id, after=after)
        events += page.data
        if not page.has_more:
            return events
        after = page.next_after


def one_trial(file_id: str, max_steps: int) -> dict[str, object]:
    return {"base_model": "tiny-random-llama", "training_file": file_id, "validation_split": 0.2,
            "search_space": {"learning_rate": [1e-3], "lora_rank": [2], "batch_size": [4],
                             "target_modules": [["q_proj", "v_proj"]]},
            "max_steps": max_steps, "max_seq_len": 64, "eval_interval": 50, "seed": 7,
            "scheduling": {"max_trials_per_pack": 1}}  # a pack of one: no room for the other tenant


def test_a_long_pack_is_preempted_for_another_tenants_short_task_and_resumes_losing_no_step(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_SCHEDULER_TICK_S": "0.5",
                "LORAPLANE_HEARTBEAT_S": "1", "LORAPLANE_PREEMPT_MIN_SLICE_S": str(SLICE_S)})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp_path) as c:
        _, token = start_embedded(c, port)
        with tenant_client(base_url, token, "team-long") as a, tenant_client(base_url, token, "team-short") as b:
            long_task = submit(a, one_trial(upload(a, arithmetic_rows()), max_steps=20_000))
            (long_trial,) = a.tasks.trials(long_task.id).data
            # A has trained past its slice before B arrives (the slice counts from its pack's start).
            wait_progressing(lambda: a.tasks.trial(long_task.id, long_trial.id).steps_done >= 20,
                             lambda: task_progress(a, long_task.id), "the long trial's first steps")
            short_task = submit(b, one_trial(upload(b, arithmetic_rows()), max_steps=6))
            events, ended = follow_events(b, short_task.id)
            assert ended.state == "succeeded", [e.type for e in events]

            # A was paused for B (not finished) and is back in the queue or training again.
            paused = a.tasks.trial(long_task.id, long_trial.id)
            assert paused.state in ("pending", "running") and paused.steps_done < 20_000
            a_events = all_events(a, long_task.id)
            preempted = [e for e in a_events if e.type == "trial.preempted"]
            assert preempted and "team-short" not in preempted[0].message  # tenants are named by id, not name
            assert any(e.type == "trial.paused" for e in a_events)
            checkpoint = paused.checkpoint_step
            assert checkpoint is not None and checkpoint > 0

            # A resumes from its checkpoint and trains on; cancelled once past it, its curve has each step once.
            wait_progressing(lambda: a.tasks.trial(long_task.id, long_trial.id).steps_done > checkpoint + 20,
                             lambda: task_progress(a, long_task.id), "the long trial training again")
            a.tasks.cancel(long_task.id)
            steps = [p.step for p in a.tasks.metrics(long_task.id, long_trial.id).train]
            assert steps == list(range(1, len(steps) + 1)), "a step recorded twice or missing around the pause"
            assert len(steps) > checkpoint
