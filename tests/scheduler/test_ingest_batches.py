"""Ingest stores a batch's points with one statement (scheduler/service/ingest.py, `PointBuffer`): what a batch of
many reports leaves in the database is what applying them one by one would leave. Against the real Postgres and
Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select

from common.db import session_scope
from common.messages import Point
from common.metrics import selection_loss
from common.tables import MetricPoint, Trial
from scheduler.service.daemon import SchedulerDaemon
from tests.scheduler.test_daemon import WORKER, fresh_daemon, heartbeat, live_pack, make_task, report


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    yield fresh_daemon(WORKER)


def stored(trial_id: str) -> list[tuple[int, str, float]]:
    with session_scope() as s:
        return sorted((p.step, p.split, p.loss) for p in s.scalars(
            select(MetricPoint).where(MetricPoint.trial_id == trial_id)))


def test_a_batch_of_points_and_endings_stores_each_point_once_and_scores_from_the_whole_curve(
        daemon: SchedulerDaemon) -> None:
    _, (first, second) = make_task(2, steps=6)
    heartbeat()
    daemon.step(block_s=0.2)
    pack = live_pack()
    report("pack.started", pack_id=pack.id)
    daemon.step(block_s=0.2)
    # One batch: points of both trials over several messages, one message sent twice (a worker's resend), the first
    # trial ending mid-batch (its points before the ending count, a point after it does not), the second trial's
    # curve going on after that.
    both = [Point(first, 1, "train", 3.0), Point(second, 1, "train", 3.1), Point(first, 2, "val", 2.0)]
    report("points", pack_id=pack.id, points=both)
    report("points", pack_id=pack.id, points=both)
    report("points", pack_id=pack.id, points=[Point(first, 4, "val", 1.0), Point(second, 2, "val", 2.5)])
    report("trial.finished", pack_id=pack.id, trial_id=first, status="completed", steps_done=6,
           best_val_loss=1.0, final_train_loss=2.0, best_step=4, points=[Point(first, 6, "train", 2.0)])
    report("points", pack_id=pack.id, points=[Point(first, 7, "train", 9.9), Point(second, 4, "val", 2.4)])
    daemon.step(block_s=0.2)
    assert stored(first) == [(1, "train", 3.0), (2, "val", 2.0), (4, "val", 1.0), (6, "train", 2.0)]
    assert stored(second) == [(1, "train", 3.1), (2, "val", 2.5), (4, "val", 2.4)]
    with session_scope() as s:
        done, running = s.get_one(Trial, first), s.get_one(Trial, second)
        assert done.state == "completed" and done.steps_done == 6
        assert done.selection_loss == pytest.approx(selection_loss([2.0, 1.0]))
        assert running.state == "running" and running.steps_done == 1 and running.last_train_loss == 3.1
        assert running.selection_loss == pytest.approx(selection_loss([2.5, 2.4]))
        assert running.best_val_loss == 2.4 and running.best_step == 4


def test_a_workers_points_go_first_only_until_another_report_of_its_own() -> None:
    """The daemon stores a batch's points in parallel transactions before the rest (scheduler/service/daemon.py,
    `_points_first`): only those each worker sent before any other report of its, so that each worker's reports are
    applied in the order it sent them; other workers' points are not held back by it."""
    from common.messages import PackFinished, Points, Wake
    from scheduler.service.daemon import _points_first

    def points(worker: str, step: int) -> Points:
        return Points(worker_id=worker, pack_id=f"pack-{worker}", points=[Point(f"t-{worker}", step, "train", 1.0)])

    a1, b1, a2, b2 = points("a", 1), points("b", 1), points("a", 2), points("b", 2)
    ended, wake = PackFinished(worker_id="a", pack_id="pack-a"), Wake(reason="task")
    first, rest = _points_first([a1, b1, wake, ended, a2, b2])
    assert first == [a1, b1, b2]  # a wake is no worker's: b's later points still go first
    assert rest == [wake, ended, a2]  # a's point after its pack's end follows it
