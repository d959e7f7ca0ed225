"""Row locks never make an insert that only references the locked row wait (PostgreSQL).

Every row lock the service takes is FOR NO KEY UPDATE (scheduler/service/ingest.py `lock_trials` says why). An
event or a loss point names its tenant, task and trial by foreign key, and inserting it takes FOR KEY SHARE on
each. Under FOR UPDATE such an insert waited for the lock's holder, and a cancel (holding its task's row, waiting
for a trial) deadlocked with the scheduler's ingest (holding the trial, inserting an event naming the task): the
cancel answered 503 in a clean-clone run of tests/e2e/test_multi_gpu_worker.py.

Each case holds one of the service's own locks in one transaction and inserts, in another, what references the
locked row, under a lock timeout: a wait fails the insert with LockNotAvailable instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from api.queries import get_task
from api.services.tenants import live_tenant
from common.db import session_scope
from common.events import record_event
from common.tables import MetricPoint, Task, Tenant, Trial
from tests.factories import TenantKey, make_task, trial_ids

LOCK_TIMEOUT = "2s"


@contextmanager
def held(lock: Callable[[Session], object]) -> Iterator[None]:
    """`lock` taken in a transaction that stays open for the block."""
    with session_scope() as session:
        lock(session)
        yield


def insert_references(tenant_id: str, task_id: str, trial_id: str) -> None:
    """What the scheduler's ingest writes for a trial: an event naming its task and trial, and a loss point."""
    with session_scope() as session:
        session.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
        record_event(session, tenant_id=tenant_id, task_id=task_id, trial_id=trial_id, type="trial.metrics",
                     message="points")
        session.add(MetricPoint(trial_id=trial_id, step=1, split="train", loss=1.0))


def _task_lock(tenant_id: str, task_id: str) -> Callable[[Session], object]:
    return lambda s: get_task(s, tenant_id=tenant_id, task_id=task_id, lock=True)  # the cancel's


def _tenant_lock(tenant_id: str) -> Callable[[Session], object]:
    return lambda s: live_tenant(s, tenant_id, lock=True)  # the tenant deletion's


def _trial_lock(trial_id: str) -> Callable[[Session], object]:  # ingest.lock_trials'
    return lambda s: s.execute(select(Trial.id).where(Trial.id == trial_id).with_for_update(key_share=True)).all()


def _submission_lock(tenant_id: str) -> Callable[[Session], object]:  # task submission's and the upload's
    return lambda s: s.scalar(select(Tenant.deleted_at).where(Tenant.id == tenant_id).with_for_update(key_share=True))


@pytest.mark.parametrize("which", ["task", "tenant", "trial", "submission"])
def test_an_insert_referencing_a_locked_row_does_not_wait(client: TestClient, tenant: TenantKey, which: str) -> None:
    task_id = make_task(client, tenant)["id"]
    trial_id = trial_ids(task_id)[0]
    lock = {"task": _task_lock(tenant.id, task_id), "tenant": _tenant_lock(tenant.id),
            "trial": _trial_lock(trial_id), "submission": _submission_lock(tenant.id)}[which]
    with held(lock):
        insert_references(tenant.id, task_id, trial_id)  # raises LockNotAvailable after 2 s if it waited


def test_the_check_sees_a_wait_under_for_update(client: TestClient, tenant: TenantKey) -> None:
    """The control: under the FOR UPDATE the service took before, the same insert waits, and times out."""
    task_id = make_task(client, tenant)["id"]
    trial_id = trial_ids(task_id)[0]
    with held(lambda s: s.execute(select(Task.id).where(Task.id == task_id).with_for_update()).all()):
        with pytest.raises(OperationalError, match="lock timeout"):
            insert_references(tenant.id, task_id, trial_id)
