"""A queued task explains itself across a model switch, through the daemon against the real Postgres and Redis (we
play the worker by publishing its reports, as tests/scheduler/test_daemon.py does): task A on one model occupies the
only worker, tasks B and C on another wait behind A's pack with their places in the queue and a predicted start, told
by one `task.waiting` event each however many rounds pass, and start when A's pack ends (the field clears)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import select

from common import states
from common.celery import worker_queue
from common.db import session_scope
from common.settings import get_settings
from common.tables import Event, Pack, Task, Trial, utcnow
from scheduler.service.daemon import SchedulerDaemon
from scheduler.service.waits import WAITING
from tests.scheduler.test_daemon import WORKER, fresh_daemon, heartbeat, live_pack, make_task, report
from tests.scheduler.test_model_availability import SMOL, TINY, age_models


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    yield fresh_daemon(WORKER)


def running(pack_id: str) -> None:
    """The worker's heartbeat while it runs ``pack_id``."""
    report("heartbeat", queue=worker_queue(get_settings(), WORKER), device="cpu", max_slots=8, pack_id=pack_id)


def waiting_events(task_id: str) -> list[Event]:
    with session_scope() as s:
        return list(s.scalars(select(Event).where(Event.task_id == task_id, Event.type == WAITING)
                              .order_by(Event.id)))


def waiting_of(task_id: str) -> dict[str, object] | None:
    with session_scope() as s:
        return s.get_one(Task, task_id).waiting


def test_a_task_behind_another_models_pack_says_why_where_and_when_then_starts(daemon: SchedulerDaemon) -> None:
    a_task, a_trials = make_task(4, model=TINY, steps=30)
    age_models(SMOL, TINY)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    assert pack.base_model == TINY and sorted(pack.trial_ids) == sorted(a_trials)
    assert waiting_of(a_task) is None  # every trial of it started
    report("pack.started", pack_id=pack.id)
    b_task, b_trials = make_task(3, model=SMOL)
    c_task, _ = make_task(1, model=SMOL)
    for _ in range(3):  # round after round: the field is kept, the event is not repeated
        running(pack.id)
        daemon.step(block_s=0.1)

    b, c = waiting_of(b_task), waiting_of(c_task)
    assert b is not None and c is not None
    assert (b["reason"], b["position"], b["pack_id"], b["worker_id"], b["waiting_trials"]) == (
        "behind_pack", 1, pack.id, "w-test", 3)
    assert (c["reason"], c["position"]) == ("behind_pack", 2)
    assert isinstance(b["estimated_start_at"], str) and isinstance(b["updated_at"], str)
    assert str(b["message"]).startswith(f"3 trials waiting behind pack {pack.id} on worker w-test (4 trials of {TINY}")
    assert "1st in queue; starts in" in str(b["message"]) and "2nd in queue" in str(c["message"])
    [told] = waiting_events(b_task)
    assert told.message == b["message"] and told.level == "info"
    assert told.data["reason"] == "behind_pack" and told.data["position"] == 1 and told.data["pack_id"] == pack.id
    assert told.data["estimated_start_at"] == b["estimated_start_at"]
    assert len(waiting_events(c_task)) == 1 and waiting_events(a_task) == []

    # A's pack ends: B and C are placed (one pack of their model on the freed worker) and their fields clear.
    for t in a_trials:
        report("trial.finished", pack_id=pack.id, trial_id=t, status="completed", steps_done=30, best_val_loss=1.0,
               best_step=30, final_train_loss=1.0, adapter_key=f"adapters/{t}.tar.gz")
    report("pack.finished", pack_id=pack.id)
    daemon.step(block_s=0.2)
    with session_scope() as s:
        new = s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).one()
        assert new.base_model == SMOL and set(b_trials) <= set(new.trial_ids)
        assert {t.state for t in s.scalars(select(Trial).where(Trial.task_id == b_task))} == {states.TRIAL_RUNNING}
    assert waiting_of(b_task) is None and waiting_of(c_task) is None
    assert len(waiting_events(b_task)) == 1  # the start is said by trial.running and task.planned


def test_no_live_worker_then_a_retry_backoff(daemon: SchedulerDaemon) -> None:
    """With no worker alive the task says so; trials held by a requeue backoff are out of the queue until it ends."""
    age_models(TINY)
    task_id, trial_ids = make_task(2, model=TINY)
    daemon.step(block_s=0.05)
    waiting = waiting_of(task_id)
    assert waiting is not None and (waiting["reason"], waiting["position"]) == ("no_worker", 1)
    with session_scope() as s:
        for t in s.scalars(select(Trial).where(Trial.task_id == task_id)):
            t.not_before = utcnow() + timedelta(seconds=120)
    daemon.step(block_s=0.05)
    waiting = waiting_of(task_id)
    assert waiting is not None and (waiting["reason"], waiting["position"]) == ("retry_backoff", None)
    assert "requeued after a failure" in str(waiting["message"])
    assert [e.data["reason"] for e in waiting_events(task_id)] == ["no_worker", "retry_backoff"]
