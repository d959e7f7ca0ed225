"""A batch of reports locks the trials it names in id order before it waits for any (`ingest.lock_trials`), as the
API's cancel locks a task's trials: two transactions that locked the same trials in different orders could each
wait for the other, and PostgreSQL breaks the cycle by failing one. A cancel answered 503 so while a pack over two
GPUs reported its trials' points in interleaved order (tests/e2e/test_multi_gpu_worker.py, found in a CI run)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from common.db import get_engine, session_scope
from common.messages import Point, Points
from scheduler.service.ingest import ingest
from tests.scheduler.test_daemon import make_task


def test_a_batch_holds_no_trial_while_it_waits_for_one_with_a_lower_id(clean_db: None) -> None:
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        pytest.skip("row locks are PostgreSQL's (SQLite locks the whole file)")
    _, trials = make_task(2)
    low, high = sorted(trials)
    holder = engine.connect()
    holder.begin()
    holder.execute(text("SELECT id FROM trials WHERE id = :id FOR UPDATE"), {"id": low})

    def batch() -> None:  # the higher id's points first, as another rank's report may come first
        with session_scope() as session:
            ingest(session, [Points(pack_id="pack-x", worker_id="w",
                                    points=[Point(high, 1, "train", 1.0), Point(low, 1, "train", 1.0)])])

    worker = threading.Thread(target=batch)
    worker.start()
    try:
        time.sleep(1.0)  # the batch is now waiting for `low`
        assert worker.is_alive(), "the batch did not wait for the trial another transaction holds"
        with engine.connect() as probe, probe.begin():
            try:
                probe.execute(text("SELECT id FROM trials WHERE id = :id FOR UPDATE NOWAIT"), {"id": high})
            except OperationalError:
                pytest.fail("the batch holds the higher trial while it waits for the lower one")
    finally:
        holder.rollback()
        holder.close()
        worker.join(timeout=30)
    assert not worker.is_alive()
