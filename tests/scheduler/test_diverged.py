"""A diverged trial's non-finite losses never wedge ingest (found on the H200, issue 34's benchmark: a NaN point
became NULL in SQLite, the batch failed its NOT NULL column, and the scheduler retried it for ever). Against the real
Postgres and Redis (where NaN is storable: it is left out all the same, so the curves hold only numbers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select

from common.db import session_scope
from common.messages import Point
from common.tables import MetricPoint, Trial
from scheduler.service.daemon import SchedulerDaemon
from tests.scheduler.test_daemon import WORKER, fresh_daemon, heartbeat, live_pack, make_task, report


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    yield fresh_daemon(WORKER)


def test_non_finite_losses_are_left_out_and_the_rest_of_the_batch_is_stored(daemon: SchedulerDaemon) -> None:
    _, (trial_id,) = make_task(1, steps=4)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    report("points", pack_id=pack.id, points=[
        Point(trial_id, 1, "train", 2.5), Point(trial_id, 2, "train", float("nan")), Point(trial_id, 2, "val", 2.0),
        Point(trial_id, 3, "train", float("inf")), Point(trial_id, 4, "val", float("-inf"))])
    report("trial.finished", pack_id=pack.id, trial_id=trial_id, status="completed", steps_done=4,
           best_val_loss=float("nan"), final_train_loss=float("nan"), best_step=2)
    report("points", pack_id=pack.id, points=[Point(trial_id, 4, "train", 1.5)])  # read after: not wedged
    daemon.step(block_s=0.2)
    with session_scope() as s:
        stored = sorted((p.step, p.split, p.loss) for p in s.scalars(
            select(MetricPoint).where(MetricPoint.trial_id == trial_id)))
        trial = s.get_one(Trial, trial_id)
        assert stored == [(1, "train", 2.5), (2, "val", 2.0)]
        assert trial.state == "completed" and trial.best_val_loss is None and trial.last_train_loss == 2.5
