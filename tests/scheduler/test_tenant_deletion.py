"""A tenant deleted through the API while its trials train: the scheduler stops them as it stops a cancelled
task's (one `stop_trials` command to their pack), and the other tenants' trials train on. Real Postgres, Redis and
Celery broker; we play the worker, as tests/scheduler/test_daemon.py does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from common import states
from common.bus import commands_stream, get_bus
from common.db import session_scope
from common.tables import Pack, Task, Trial
from scheduler.service.daemon import SchedulerDaemon
from tests.factories import ADMIN
from tests.scheduler.test_daemon import WORKER, fresh_daemon, heartbeat, make_task


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    yield fresh_daemon(WORKER)


def test_a_deleted_tenants_running_trials_are_stopped_and_the_others_train_on(daemon: SchedulerDaemon) -> None:
    from api.main import create_app

    doomed_task, doomed_trials = make_task(2)
    kept_task, kept_trials = make_task(2)
    tail = get_bus().tail_id(commands_stream(WORKER))
    heartbeat()
    daemon.step(block_s=0.2)
    with session_scope() as s:
        [pack] = s.scalars(select(Pack).where(Pack.state.in_(states.PACK_LIVE))).all()
        assert sorted(pack.trial_ids) == sorted(doomed_trials + kept_trials)
        tenant_id = s.get_one(Task, doomed_task).tenant_id

    with TestClient(create_app()) as client:
        assert client.delete(f"/v1/admin/tenants/{tenant_id}", headers=ADMIN).status_code == 200
    daemon.tick()
    daemon.tick()

    commands = [m for _, m in get_bus().read_after(commands_stream(WORKER), tail, count=10, block_s=0.1)]
    assert [(c["type"], c["pack_id"], sorted(c["trial_ids"])) for c in commands] == [
        ("stop_trials", pack.id, sorted(doomed_trials))]
    with session_scope() as s:
        assert s.get_one(Task, doomed_task).state == states.TASK_CANCELLED
        assert s.get_one(Task, kept_task).state in (states.TASK_QUEUED, states.TASK_RUNNING)
        assert {s.get_one(Trial, t).state for t in kept_trials} == {states.TRIAL_RUNNING}
