"""Within one task, event ids become visible in increasing order, so a reader paging by id misses none."""

from __future__ import annotations

import threading
import time

from sqlalchemy import select

from common.db import session_scope
from common.events import record_event
from common.tables import Event
from tests.scheduler.test_daemon import make_task


def test_a_second_writer_of_a_tasks_events_waits_for_the_first_to_commit(clean_db: None) -> None:
    task_id, _ = make_task(1)
    with session_scope() as s:
        from common.tables import Task

        tenant_id = s.get(Task, task_id).tenant_id  # type: ignore[union-attr]
    second_done = threading.Event()

    def second_writer() -> None:
        with session_scope() as s:
            record_event(s, tenant_id=tenant_id, task_id=task_id, type="t.second", message="second")
        second_done.set()

    with session_scope() as first:
        record_event(first, tenant_id=tenant_id, task_id=task_id, type="t.first", message="first")
        first.flush()  # the first event has its id; its transaction is still open
        writer = threading.Thread(target=second_writer)
        writer.start()
        time.sleep(0.5)
        # Without the lock the second event would take a higher id and commit before the first one.
        assert not second_done.is_set()
    writer.join(timeout=10)
    assert second_done.is_set()
    with session_scope() as s:
        types = [e.type for e in s.scalars(select(Event).where(Event.task_id == task_id).order_by(Event.id))]
    assert types == ["t.first", "t.second"]


def test_the_lock_is_taken_again_in_a_later_transaction_of_the_same_session(clean_db: None) -> None:
    task_id, _ = make_task(1)
    from common.db import _session_factory
    from common.tables import Task

    session = _session_factory()()
    try:
        tenant_id = session.get(Task, task_id).tenant_id  # type: ignore[union-attr]
        record_event(session, tenant_id=tenant_id, task_id=task_id, type="a", message="a")
        session.commit()
        record_event(session, tenant_id=tenant_id, task_id=task_id, type="b", message="b")
        session.flush()
        # This session holds the task's lock again in its new transaction: another writer must wait.
        done = threading.Event()

        def other() -> None:
            with session_scope() as s:
                record_event(s, tenant_id=tenant_id, task_id=task_id, type="c", message="c")
            done.set()

        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.5)
        assert not done.is_set()
        session.commit()
        thread.join(timeout=10)
        assert done.is_set()
    finally:
        session.close()
