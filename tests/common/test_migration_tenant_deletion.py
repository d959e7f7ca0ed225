"""Revision 0015 (tenant deletion) leaves every existing tenant live and downgrades cleanly, on SQLite and on
Postgres."""

from __future__ import annotations

from sqlalchemy import text

from common.db import make_engine
from tests.common.conftest import alembic, table_columns


def test_0015_keeps_existing_tenants_live_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0014")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, weight, max_concurrent_trials, max_trials_per_task, "
                          "max_file_bytes, max_storage_bytes, max_files, created_at) "
                          "VALUES ('tenant-old', 'old', 1.0, 8, 8, 1000, 1000, 10, CURRENT_TIMESTAMP)"))
    engine.dispose()

    alembic(scratch_url, "upgrade", "0015")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT deleted_at FROM tenants WHERE id = 'tenant-old'")).one() == (None,)
        conn.execute(text("UPDATE tenants SET deleted_at = CURRENT_TIMESTAMP WHERE id = 'tenant-old'"))
    engine.dispose()

    alembic(scratch_url, "downgrade", "0014")
    assert "deleted_at" not in table_columns(scratch_url, "tenants")
    alembic(scratch_url, "upgrade", "head")
    assert "deleted_at" in table_columns(scratch_url, "tenants")
