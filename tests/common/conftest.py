"""What the migration tests share: a scratch database of each kind, and Alembic run on it to a given revision."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect, text

from common.db import MIGRATIONS_DIR, make_engine
from tests.conftest import SERVER_URL


def alembic(url: str, action: str, revision: str) -> None:
    """`alembic upgrade|downgrade <revision>` on the database at ``url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    getattr(command, action)(cfg, revision)


@pytest.fixture(params=["sqlite", "postgres"])
def scratch_url(request: pytest.FixtureRequest, tmp_path: Path, database: str) -> Iterator[str]:
    """An empty database, SQLite and then Postgres, dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'db.sqlite'}"
        return
    name = f"loraplane_migration_{uuid.uuid4().hex[:8]}"
    admin = create_engine(SERVER_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{SERVER_URL.rpartition('/')[0]}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def table_columns(url: str, table: str) -> set[str]:
    """The names of `table`'s columns in the database at `url` (what a migration test checks after each step)."""
    engine = make_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()
