"""Revision 0019 (file_token_lengths) adds the table of each file's row lengths per model and downgrades cleanly, on
SQLite and on Postgres."""

from __future__ import annotations

from sqlalchemy import inspect

from common.db import make_engine
from tests.common.conftest import alembic, table_columns


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_0019_adds_the_lengths_table_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0018")
    assert "file_token_lengths" not in tables(scratch_url)
    alembic(scratch_url, "upgrade", "0019")
    assert table_columns(scratch_url, "file_token_lengths") == {"file_id", "base_model", "tokenizer", "lengths",
                                                                 "created_at"}
    alembic(scratch_url, "downgrade", "0018")
    assert "file_token_lengths" not in tables(scratch_url)
    alembic(scratch_url, "upgrade", "head")
    assert "file_token_lengths" in tables(scratch_url)
