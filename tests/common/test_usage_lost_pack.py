"""Usage counts each step once whatever happens to the pack (issue 32): a pack declared lost while its process
trained on (its heartbeat starved) bills its time up to the moment it was declared lost, and nothing of what that
process reported afterwards; its trials' steps are billed where they are trained again. The real scheduler daemon on
the real Postgres and Redis; we play the worker process as tests/scheduler/test_liveness.py does."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from sqlalchemy import select

from common import states
from common.db import session_scope
from common.tables import Pack, Trial, TrialUsage, Worker, as_utc
from common.usage import gpu_seconds_by_trial, task_usage
from scheduler.service.daemon import SchedulerDaemon
from tests.scheduler.test_daemon import WORKER, fresh_daemon, live_pack
from tests.scheduler.test_liveness import FakeProcess, start_pack


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    d = fresh_daemon(WORKER)
    d.faults = replace(d.faults, requeue_backoff_s=0)  # the requeued trials are placed again at once
    yield d


def finish_pack(proc: FakeProcess, pack_id: str, trial_ids: list[str], tokens: int) -> None:
    for t in trial_ids:
        proc.report("trial.finished", pack_id=pack_id, trial_id=t, status="completed", steps_done=20,
                    best_val_loss=0.5, best_step=20, final_train_loss=0.5, adapter_key=f"a/{t}", points=[],
                    pack_steps=16, pack_tokens=tokens)
    proc.report("pack.finished", pack_id=pack_id)


def test_a_pack_lost_while_its_process_trains_on_is_billed_once(daemon: SchedulerDaemon) -> None:
    proc = FakeProcess()
    first, trial_ids = start_pack(daemon, proc)  # trained to a checkpoint at step 4
    task_id = daemon_task(trial_ids)
    with session_scope() as s:  # its beats stopped coming (starved): past the timeout it is declared lost
        worker = s.get_one(Worker, WORKER)
        worker.last_heartbeat = worker.last_heartbeat.replace(year=2000)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        lost = s.get_one(Pack, first.id)
        assert lost.state == states.PACK_LOST and lost.finished_at is not None
        lost_at = as_utc(lost.finished_at)
    # ...but its process trained on, unaware, and reports the trials' ends and its own (an abort comes too late).
    finish_pack(proc, first.id, trial_ids, tokens=5000)
    proc.beat(first.id)
    daemon.step(block_s=0.2)
    # The trials were placed again (from step 4) and train to the end in a new pack.
    second = live_pack()
    assert second.id != first.id and sorted(second.trial_ids) == sorted(trial_ids)
    proc.beat(second.id)
    proc.report("pack.started", pack_id=second.id)
    finish_pack(proc, second.id, trial_ids, tokens=800)
    proc.beat(None)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert {t.state for t in s.scalars(select(Trial))} == {states.TRIAL_COMPLETED}
        lost, done = s.get_one(Pack, first.id), s.get_one(Pack, second.id)
        assert lost.state == states.PACK_LOST and as_utc(lost.finished_at) == lost_at  # its time ends at the loss
        assert done.state == states.PACK_FINISHED and done.started_at and done.finished_at
        # Only the pack that trained the steps the trials kept bills their tokens...
        assert {u.pack_id for u in s.scalars(select(TrialUsage))} == {second.id}
        tokens, seconds = task_usage(s, task_id)
        assert tokens == 800 * len(trial_ids)
        # ...and the GPU time is the lost pack's until its loss plus the new pack's, nothing after the loss twice.
        lost_s = (lost_at - as_utc(lost.started_at)).total_seconds()  # type: ignore[arg-type]
        done_s = (as_utc(done.finished_at) - as_utc(done.started_at)).total_seconds()
        assert seconds == pytest.approx(lost_s + done_s)
        # The lost pack's time is shared equally: the reports of what it trained are partial, and none is counted.
        shares = gpu_seconds_by_trial(s, trial_ids=set(trial_ids))
        assert shares == pytest.approx({t: lost_s / len(trial_ids) + done_s / len(trial_ids) for t in trial_ids})


def daemon_task(trial_ids: list[str]) -> str:
    with session_scope() as s:
        return s.get_one(Trial, trial_ids[0]).task_id
