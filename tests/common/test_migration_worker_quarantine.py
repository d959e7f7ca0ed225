"""Revision 0013 (worker quarantine) gives existing trials no worker loss and no backoff, existing workers no lost
pack and no quarantine, and downgrades cleanly, on SQLite and on Postgres."""

from __future__ import annotations

from sqlalchemy import text

from common.db import make_engine
from tests.common.conftest import alembic, table_columns

TRIAL_COLUMNS = {"worker_losses", "not_before"}
WORKER_COLUMNS = {"lost_packs", "quarantines", "quarantined_until"}


def test_0013_starts_every_worker_and_trial_with_a_clean_record_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0012")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO workers (id, queue, device, max_slots, state, last_heartbeat, registered_at) "
                          "VALUES ('w-old', 'q', 'cuda:0', 8, 'alive', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO tenants (id, name, weight, max_concurrent_trials, max_trials_per_task, "
                          "max_file_bytes, max_storage_bytes, max_files, created_at) "
                          "VALUES ('ten', 'n', 1, 1, 1, 1, 1, 1, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO base_models (name, kind, description, created_at) "
                          "VALUES ('m', 'hf', '', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO files (id, tenant_id, filename, purpose, bytes, rows, format, sha256, "
                          "storage_key, created_at) VALUES ('f', 'ten', 'd', 'fine-tune', 1, 1, 'messages', 'x', 'k', "
                          "CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO tasks (id, tenant_id, state, base_model, training_file_id, spec, created_at) "
                          "VALUES ('task', 'ten', 'running', 'm', 'f', '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text('INSERT INTO trials (id, task_id, tenant_id, "index", state, hyperparameters, total_steps, '
                          "steps_done, attempts, created_at) "
                          "VALUES ('t-old', 'task', 'ten', 0, 'pending', '{}', 10, 0, 2, CURRENT_TIMESTAMP)"))
    engine.dispose()

    alembic(scratch_url, "upgrade", "0013")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT lost_packs, quarantines, quarantined_until FROM workers")).one() == (
            None, 0, None)
        # The attempts it spent before stay spent: the past is not judged again.
        assert conn.execute(text("SELECT attempts, worker_losses, not_before FROM trials")).one() == (2, 0, None)
    engine.dispose()

    alembic(scratch_url, "downgrade", "0012")
    assert not TRIAL_COLUMNS & table_columns(scratch_url, "trials")
    assert not WORKER_COLUMNS & table_columns(scratch_url, "workers")
    alembic(scratch_url, "upgrade", "head")
    assert TRIAL_COLUMNS <= table_columns(scratch_url, "trials")
    assert WORKER_COLUMNS <= table_columns(scratch_url, "workers")
