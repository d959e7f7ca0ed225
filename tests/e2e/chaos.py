"""What the chaos tests share (tests/e2e/test_chaos.py: embedded, test_chaos_distributed.py: distributed): the
two tenants' tasks a fault is injected into, and the checks that both recovered."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from loraplane.client import Client, Event
from tests.e2e.flow import (
    arithmetic_rows,
    follow_events,
    grid_task,
    submit,
    task_progress,
    tenant_client,
    upload,
    wait_for,
    wait_progressing,
)
from tests.e2e.procs import (
    START_CEILING_S,
    Cluster,
    Proc,
    child_pids,
    is_worker,
    wait_ready,
)

EVAL_EVERY = 20  # both tasks' eval_interval
A_STEPS = 600  # long enough to still train when the fault comes (at the first checkpoint), short enough to end soon
B_STEPS = 400
CHAOS_ENV = {
    "LORAPLANE_SCHEDULER_TICK_S": "0.5", "LORAPLANE_HEARTBEAT_S": "1", "LORAPLANE_WORKER_TIMEOUT_S": "8",
    # A checkpoint within a fraction of a second of training, not a minute: the faults come once every trial has one.
    "LORAPLANE_CHECKPOINT_INTERVAL_S": "0.2",
    # A requeued trial may be placed again after 1 s, not the default 5 s: every scenario requeues (a worker's loss)
    # and waits that long before the trials train again; nothing here tests the backoff's length.
    "LORAPLANE_REQUEUE_BACKOFF_S": "1",
    # On 2 busy cores torch's second thread makes the tiny model train ~10x slower (threads wait for each other
    # while the API and the scheduler hold the other core): one thread per process. A worker sets its torch threads
    # from LORAPLANE_WORKER_CPU_THREADS (default 2, which overrides OMP_NUM_THREADS): that one too (tests/conftest.py
    # sets it for every process the suite starts).
    "OMP_NUM_THREADS": "1",
    "LORAPLANE_WORKER_CPU_THREADS": "1",
}
# A worker killed and started again at once: a timeout far longer than its restart (a new worker process takes a
# minute or more to send its first heartbeat on two loaded cores), so only the new process's first heartbeat can end
# the dead one's pack (before issue 14, packs hung for good under the default timeout).
RESTART_TIMEOUT_S = 600
EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE")


@dataclass
class Tasks:
    """Tenant A's long task and tenant B's, each with its tenant's client."""

    a: Client
    a_task: str
    b: Client
    b_task: str

    def each(self) -> list[tuple[str, Client, str]]:
        return [("A", self.a, self.a_task), ("B", self.b, self.b_task)]

    def close(self) -> None:
        self.a.close()
        self.b.close()


def long_task(file_id: str, learning_rates: list[float], max_steps: int,
              base_model: str = "tiny-random-llama") -> dict[str, Any]:
    body = grid_task(file_id, base_model, max_steps=max_steps)
    body["search_space"] = {"learning_rate": learning_rates, "lora_rank": [4], "batch_size": [4],
                            "target_modules": [["q_proj", "v_proj"]]}
    body["eval_interval"] = EVAL_EVERY
    return body


def submit_both(base_url: str, admin_token: str, b_model: str = "tiny-random-llama") -> Tasks:
    """A's task and B's, on `tiny-random-llama` (one pack holds both), or B's on ``b_model`` (a pack of its own)."""
    a = tenant_client(base_url, admin_token, "chaos-a")
    b = tenant_client(base_url, admin_token, "chaos-b")
    a_task = submit(a, long_task(upload(a, arithmetic_rows()), [1e-3, 5e-3], A_STEPS)).id
    b_task = submit(b, long_task(upload(b, arithmetic_rows(24)), [2e-3], B_STEPS, b_model)).id
    return Tasks(a, a_task, b, b_task)


def checkpoints_before_fault(tasks: Tasks) -> dict[str, int]:
    """Waits until every trial of both tasks trains and has reported a checkpoint, none having finished; returns
    each trial's newest checkpoint step (the least a resume after the fault may start from)."""

    def all_checkpointed() -> dict[str, int] | None:
        trials = [t for _, lp, task_id in tasks.each() for t in lp.tasks.trials(task_id)]
        finished = [t for t in trials if t.done]
        assert not finished, f"a trial finished before the fault could be injected (make the tasks longer): {finished}"
        if trials and all(t.state == "running" and (t.checkpoint_step or 0) > 0 for t in trials):
            return {t.id: int(t.checkpoint_step or 0) for t in trials}
        return None

    checkpoints: dict[str, int] = wait_progressing(all_checkpointed, lambda: both_progress(tasks),
                                                   "a checkpoint of every trial", interval_s=0.2)
    return checkpoints


def both_progress(tasks: Tasks) -> tuple[object, ...]:
    return tuple(task_progress(lp, task_id) for _, lp, task_id in tasks.each())


def assert_recovered(tasks: Tasks, checkpoints: dict[str, int], *, requeues: int) -> list[Event]:
    """Both tasks succeed with every trial complete; each step's train point is there exactly once; a trial
    that was requeued resumed from the checkpoint it had at the fault, or a newer one (not from step 0).
    (Validation points, one every EVAL_EVERY steps, are checked the same way.)
    `requeues`: how many times the faults ended the pack, each time requeuing every trial (0: an outage the
    worker trains through). Every trial ends at attempt 1: a worker's loss spends none. Returns the
    `trial.requeued` events the faults caused (blamed on the worker); a back-fill that bounced off a pack ending as
    it came (requeued at no one's blame, from its checkpoint) is no fault's doing and is not counted."""
    all_requeued: list[Event] = []
    for name, lp, task_id in tasks.each():
        events, ended = follow_events(lp, task_id)
        story = "\n".join(f"  {e.type} {e.trial_id or ''} {e.message} {e.data}" for e in events)
        assert ended.state == "succeeded", f"task {name} ended {ended.state} ({ended.error}):\n{story}"
        trials = lp.tasks.trials(task_id).data
        assert all(t.state == "completed" and t.steps_done == t.total_steps for t in trials), (trials, story)

        for row in lp.tasks.curves(task_id):
            total = int(row["total_steps"])  # a multiple of EVAL_EVERY: the last step validates anyway
            for split, expected in (("train", range(1, total + 1)), ("val", range(EVAL_EVERY, total + 1,
                                                                                   EVAL_EVERY))):
                steps = [int(point[0]) for point in row[split]]
                missing = sorted(set(expected) - set(steps))
                repeated = sorted(step for step, n in Counter(steps).items() if n > 1)
                assert steps == list(expected), (f"task {name} trial {row['trial_id']}: {split} steps missing "
                                                 f"{missing[:20]} (of {len(missing)}), repeated {repeated[:20]}")

        bounced_or_requeued = [e for e in events if e.type == "trial.requeued"]
        requeued = [e for e in bounced_or_requeued if e.data["blame"] != "none"]
        for event in bounced_or_requeued:
            assert event.trial_id in checkpoints, f"task {name}: requeued a trial that was not running: {event}"
            resume_step = int(event.data["resume_step"])
            assert resume_step >= checkpoints[event.trial_id] > 0, (
                f"task {name}: {event.trial_id} resumed from step {resume_step}, but it had a checkpoint at "
                f"step {checkpoints[event.trial_id]} before the fault:\n{story}")
        assert sorted(e.trial_id or "" for e in requeued) == sorted(t.id for t in trials for _ in range(requeues)), (
            f"task {name}: every trial of each ended pack must be requeued, once a pack ({requeues}):\n{story}")
        assert all(e.data["blame"] == "worker" for e in requeued), story
        assert all(t.attempts == 1 for t in trials), [(t.id, t.attempts) for t in trials]
        all_requeued += requeued
    return all_requeued


def assert_ended_by_new_process(requeued: list[Event], killed_at: datetime) -> None:
    """The trials went back to pending before the worker timeout could have declared the killed worker lost:
    the restarted process's first heartbeat (a new incarnation under the same id) ended its pack."""
    late = [e for e in requeued if e.created_at >= killed_at + timedelta(seconds=RESTART_TIMEOUT_S)]
    assert not late, f"requeued only after the worker timeout (killed at {killed_at}): {late}"


# ---------------------------------------------------------------------------------------------- embedded


def start_up(c: Cluster, name: str, port: int) -> Proc:
    up = c.start(name, "up", "--port", str(port))  # its worker's id: `local`
    wait_ready(f"http://127.0.0.1:{port}", [up])
    return up


def worker_child(up: Proc) -> int:
    """The pid of `up`'s supervised worker process."""
    def found() -> int | None:
        return next((pid for pid in child_pids(up.proc.pid) if is_worker(pid)), None)

    pid: int = wait_for(found, START_CEILING_S, "`loraplane up` to start its worker child")
    return pid

