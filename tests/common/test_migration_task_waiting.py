"""Revision 0017 (why a task waits) gives existing tasks no `waiting` until the scheduler's next round judges them,
keeps what it stores, and downgrades cleanly, on SQLite and on Postgres."""

from __future__ import annotations

import json

from sqlalchemy import text

from common.db import make_engine
from tests.common.conftest import alembic, table_columns


def test_0017_starts_every_task_with_nothing_said_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0016")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, weight, max_concurrent_trials, max_trials_per_task, "
                          "max_file_bytes, max_storage_bytes, max_files, created_at) "
                          "VALUES ('ten', 'n', 1, 1, 1, 1, 1, 1, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO base_models (name, kind, description, created_at) "
                          "VALUES ('m', 'hf', '', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO files (id, tenant_id, filename, purpose, bytes, rows, format, sha256, "
                          "storage_key, created_at) VALUES ('f', 'ten', 'd', 'fine-tune', 1, 1, 'messages', 'x', 'k', "
                          "CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO tasks (id, tenant_id, state, base_model, training_file_id, spec, created_at) "
                          "VALUES ('task-1', 'ten', 'queued', 'm', 'f', '{}', CURRENT_TIMESTAMP)"))
    engine.dispose()

    alembic(scratch_url, "upgrade", "0017")
    engine = make_engine(scratch_url)
    waiting = {"reason": "behind_pack", "position": 1, "estimated_start_at": "2026-11-26T12:03:00Z"}
    with engine.begin() as conn:
        assert conn.execute(text("SELECT waiting FROM tasks WHERE id = 'task-1'")).one() == (None,)
        conn.execute(text("UPDATE tasks SET waiting = :w WHERE id = 'task-1'"), {"w": json.dumps(waiting)})
        stored = conn.execute(text("SELECT waiting FROM tasks WHERE id = 'task-1'")).scalar_one()
        assert (json.loads(stored) if isinstance(stored, str) else stored) == waiting
    engine.dispose()

    alembic(scratch_url, "downgrade", "0016")
    assert "waiting" not in table_columns(scratch_url, "tasks")
    alembic(scratch_url, "upgrade", "head")
    assert "waiting" in table_columns(scratch_url, "tasks")


def test_0029_turns_a_cleared_wait_stored_as_json_null_into_sql_null(scratch_url: str) -> None:
    """A cleared `waiting` was written as JSON null, which `IS NOT NULL` selected (the cluster view's 500); 0029 makes
    it SQL NULL and leaves a real wait as it is (the column now writes None as NULL itself)."""
    alembic(scratch_url, "upgrade", "0028")
    engine = make_engine(scratch_url)
    waiting = {"reason": "behind_pack", "position": 1}
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, weight, max_concurrent_trials, max_trials_per_task, "
                          "max_file_bytes, max_storage_bytes, max_files, created_at) "
                          "VALUES ('ten', 'n', 1, 1, 1, 1, 1, 1, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO base_models (name, kind, description, created_at) "
                          "VALUES ('m', 'hf', '', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO files (id, tenant_id, filename, purpose, bytes, rows, format, sha256, "
                          "storage_key, created_at) VALUES ('f', 'ten', 'd', 'fine-tune', 1, 1, 'messages', 'x', 'k', "
                          "CURRENT_TIMESTAMP)"))
        for task_id, value in (("cleared", "null"), ("waits", json.dumps(waiting))):
            conn.execute(text("INSERT INTO tasks (id, tenant_id, state, base_model, training_file_id, spec, "
                              "created_at, waiting) VALUES (:id, 'ten', 'queued', 'm', 'f', '{}', CURRENT_TIMESTAMP, "
                              ":w)"), {"id": task_id, "w": value})
        assert conn.execute(text("SELECT count(*) FROM tasks WHERE waiting IS NOT NULL")).scalar_one() == 2
    engine.dispose()

    alembic(scratch_url, "upgrade", "0029")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        rows = dict(conn.execute(text("SELECT id, waiting FROM tasks WHERE waiting IS NOT NULL")).all())
    engine.dispose()
    assert list(rows) == ["waits"]
    assert (json.loads(rows["waits"]) if isinstance(rows["waits"], str) else rows["waits"]) == waiting
