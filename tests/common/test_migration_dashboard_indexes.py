"""Revision 0030 (the dashboard's indexes, issue 53) replaces the single-column indexes on tasks.tenant_id and
packs.state with the lists' newest-first ones, adds tasks' and packs' own, and downgrades to exactly the old ones, on
SQLite and on Postgres."""

from __future__ import annotations

from sqlalchemy import inspect

from common.db import make_engine
from tests.common.conftest import alembic


def _indexes(url: str, table: str) -> dict[str, list[str]]:
    engine = make_engine(url)
    try:
        return {str(i["name"]): [str(c) for c in i["column_names"]] for i in inspect(engine).get_indexes(table)}
    finally:
        engine.dispose()


def test_0030_indexes_the_dashboards_lists_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0029")
    before_tasks, before_packs = _indexes(scratch_url, "tasks"), _indexes(scratch_url, "packs")
    assert before_tasks["ix_tasks_tenant_id"] == ["tenant_id"] and before_packs["ix_packs_state"] == ["state"]

    alembic(scratch_url, "upgrade", "0030")
    tasks, packs = _indexes(scratch_url, "tasks"), _indexes(scratch_url, "packs")
    assert tasks["ix_tasks_tenant_id_created_at_id"] == ["tenant_id", "created_at", "id"]
    assert tasks["ix_tasks_created_at_id"] == ["created_at", "id"]
    assert packs["ix_packs_state_created_at_id"] == ["state", "created_at", "id"]
    assert packs["ix_packs_finished_at"] == ["finished_at"]
    assert tasks["ix_tasks_waiting"] == ["created_at", "id"]  # partial: the tasks whose waiting is set
    assert "ix_tasks_tenant_id" not in tasks and "ix_packs_state" not in packs  # covered by the new ones

    alembic(scratch_url, "downgrade", "0029")
    assert _indexes(scratch_url, "tasks") == before_tasks and _indexes(scratch_url, "packs") == before_packs
    alembic(scratch_url, "upgrade", "head")
