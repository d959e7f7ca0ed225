"""A trial's kept adapter checkpoints (common/checkpoints.py says which and what each is): listed, found by step."""

from __future__ import annotations

import logging
from typing import Any, cast

from sqlalchemy import CursorResult, delete, select
from sqlalchemy.orm import Session

from api.db import commit
from api.errors import not_found
from common.artifacts import get_artifact_store
from common.checkpoints import BEST, Saved, kinds
from common.tables import Checkpoint, Trial

log = logging.getLogger(__name__)


def trial_checkpoints(session: Session, trial: Trial) -> list[tuple[Checkpoint, list[str]]]:
    """The trial's kept checkpoints by step, each with its kinds."""
    rows = list(session.scalars(select(Checkpoint).where(Checkpoint.trial_id == trial.id).order_by(Checkpoint.step)))
    by_step = kinds([Saved(c.step, c.epoch_end, c.val_loss) for c in rows])
    return [(c, by_step[c.step]) for c in rows]


def checkpoint_metric(trial: Trial, checkpoint_kinds: list[str]) -> float | None:
    """The task's generative metric where it was measured: the best checkpoint's, once its trial ended and scored
    its best adapter (the worker scores that adapter only)."""
    return trial.metric_score if BEST in checkpoint_kinds and trial.finished_at is not None else None


def get_checkpoint(session: Session, trial: Trial, step: int) -> Checkpoint:
    """The trial's kept checkpoint at ``step``; 404 checkpoint_not_found."""
    found = session.scalar(select(Checkpoint).where(Checkpoint.trial_id == trial.id, Checkpoint.step == step))
    if found is None:
        raise not_found("checkpoint", f"{trial.id}:{step}")
    return found


def delete_checkpoint(session: Session, trial: Trial, step: int) -> None:
    """Deletes the trial's kept checkpoint at ``step``: its row, then its archive (its bytes leave the tenant's
    storage quota). A trial still training goes on keeping its others; the kinds of those left are theirs again (the
    best of the kept ones, the newest)."""
    found = get_checkpoint(session, trial, step)
    key = found.adapter_key
    # One statement that says whether it deleted the row: of requests racing to delete it, only the one whose DELETE
    # removed it answers 200 (the others' DELETE waits for its row lock and then matches nothing: 404). An ORM
    # `session.delete` of a row already gone only warns, and every one of them answered 200.
    deleted = cast(CursorResult[Any], session.execute(delete(Checkpoint).where(Checkpoint.id == found.id)))
    if deleted.rowcount != 1:
        session.rollback()
        raise not_found("checkpoint", f"{trial.id}:{step}")
    commit(session)
    try:  # after the commit: a failed request must never leave a listed checkpoint without its archive
        get_artifact_store().delete(key)
    except OSError:
        log.warning("could not remove the archive of deleted checkpoint %s:%d", trial.id, step, exc_info=True)
