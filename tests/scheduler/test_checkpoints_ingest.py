"""The scheduler records a trial's adapter checkpoints from its worker's reports (scheduler/service/ingest.py)."""

from __future__ import annotations

from sqlalchemy import select

from common.db import session_scope
from common.messages import CheckpointSaved
from common.tables import Checkpoint
from scheduler.service.ingest import ingest
from tests.scheduler.test_daemon import make_task


def _saved(trial_id: str, step: int, *, dropped: list[int] | None = None, loss: float | None = 1.0,
           size: int = 100) -> CheckpointSaved:
    return CheckpointSaved(pack_id="pack-x", worker_id="w", trial_id=trial_id, step=step, epoch=step / 4,
                           epoch_end=step % 4 == 0, val_loss=loss, adapter_key=f"adapter-checkpoints/t/{step}",
                           size_bytes=size, dropped_steps=dropped or [])


def _rows(trial_id: str) -> dict[int, tuple[float | None, int, bool]]:
    with session_scope() as s:
        return {c.step: (c.val_loss, c.size_bytes, c.epoch_end)
                for c in s.scalars(select(Checkpoint).where(Checkpoint.trial_id == trial_id))}


def test_checkpoints_are_added_replaced_and_dropped_as_reported(clean_db: None) -> None:
    task_id, (trial, other) = make_task(2)
    with session_scope() as s:
        ingest(s, [_saved(trial, 2, loss=2.0), _saved(trial, 4, loss=1.5), _saved(other, 4)])
    assert _rows(trial) == {2: (2.0, 100, False), 4: (1.5, 100, True)}
    with session_scope() as s:  # a replayed batch after a crash, then a step written again by a resumed trial
        ingest(s, [_saved(trial, 2, loss=2.0), _saved(trial, 4, loss=1.5)])
        ingest(s, [_saved(trial, 4, loss=1.25, size=120)])
    assert _rows(trial) == {2: (2.0, 100, False), 4: (1.25, 120, True)}
    with session_scope() as s:  # a diverged step's loss is no loss; the ones no longer kept go
        ingest(s, [_saved(trial, 8, loss=float("nan"), dropped=[2, 4, 6])])
        tenant = s.scalar(select(Checkpoint.tenant_id).where(Checkpoint.trial_id == trial))
    assert _rows(trial) == {8: (None, 100, True)}
    assert _rows(other) == {4: (1.0, 100, True)}  # another trial's are its own
    with session_scope() as s:
        ingest(s, [_saved("trial-unknown", 4)])  # a trial gone meanwhile: nothing to record
        assert s.scalar(select(Checkpoint.task_id).where(Checkpoint.trial_id == trial)) == task_id
        assert tenant is not None
