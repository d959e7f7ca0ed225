"""Revision 0006 (tenant storage quota) upgrades existing tenants to the deployment's defaults and downgrades
cleanly, on SQLite and on Postgres."""

from __future__ import annotations

from sqlalchemy import inspect, text

from common.db import make_engine
from common.settings import get_settings
from tests.common.conftest import alembic


def _tenant_columns(url: str) -> dict[str, object]:
    """Each column of `tenants` and its server default."""
    engine = make_engine(url)
    try:
        return {c["name"]: c["default"] for c in inspect(engine).get_columns("tenants")}
    finally:
        engine.dispose()


def test_0006_gives_existing_tenants_the_default_quota_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0005")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, weight, max_concurrent_trials, max_trials_per_task, "
                          "max_file_bytes, created_at) VALUES ('t1', 'old', 1, 4, 4, 1000, CURRENT_TIMESTAMP)"))
    engine.dispose()

    alembic(scratch_url, "upgrade", "0006")
    settings = get_settings()
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        row = conn.execute(text("SELECT max_storage_bytes, max_files FROM tenants WHERE id = 't1'")).one()
        assert tuple(row) == (settings.default_max_storage_bytes, settings.default_max_files)
    engine.dispose()
    columns = _tenant_columns(scratch_url)
    assert (columns["max_storage_bytes"], columns["max_files"]) == (None, None)  # the API always sets them

    alembic(scratch_url, "downgrade", "0005")
    assert not {"max_storage_bytes", "max_files"} & _tenant_columns(scratch_url).keys()
    alembic(scratch_url, "upgrade", "head")
    assert {"max_storage_bytes", "max_files"} <= _tenant_columns(scratch_url).keys()
