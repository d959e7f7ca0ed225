"""Revision 0018 (the audit log) creates an empty `audit_log` that takes an entry naming a tenant that is gone, and
downgrades cleanly, on SQLite and on Postgres."""

from __future__ import annotations

from sqlalchemy import inspect, text

from common.db import make_engine
from tests.common.conftest import alembic, table_columns


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_0018_creates_the_audit_log_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0017")
    assert "audit_log" not in _tables(scratch_url)

    alembic(scratch_url, "upgrade", "0018")
    assert table_columns(scratch_url, "audit_log") == {
        "id", "actor", "method", "route", "tenant_id", "resource_id", "created_at"}
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM audit_log")).scalar_one() == 0
        # No foreign key: the record of a read outlives the tenant (this one never existed here).
        conn.execute(text("INSERT INTO audit_log (id, actor, method, route, tenant_id, resource_id, created_at) "
                          "VALUES ('audit-1', 'admin:0123456789ab', 'GET', '/v1/tasks/{task_id}', 'tenant-gone', "
                          "'task-1', CURRENT_TIMESTAMP)"))
        assert conn.execute(text("SELECT tenant_id FROM audit_log")).one() == ("tenant-gone",)
    engine.dispose()

    alembic(scratch_url, "downgrade", "0017")
    assert "audit_log" not in _tables(scratch_url)
    alembic(scratch_url, "upgrade", "head")
    assert "audit_log" in _tables(scratch_url)
