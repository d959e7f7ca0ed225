"""The Alembic revisions build exactly the schema the models describe, on SQLite and on Postgres."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from common.db import make_engine, migrate
from common.tables import Base


def schema_drift(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_migrations_build_the_models_schema_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    migrate(url)  # idempotent: a second start changes nothing
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) == set(Base.metadata.tables) | {"alembic_version"}
    engine.dispose()
    assert schema_drift(url) == []


def test_migrations_build_the_models_schema_on_postgres(database: str) -> None:
    assert schema_drift(database) == []
