"""Revision 0012 (worker and pack gpus) gives existing workers and packs one GPU and downgrades cleanly, on SQLite
and on Postgres."""

from __future__ import annotations

from sqlalchemy import inspect, text

from common.db import make_engine
from tests.common.conftest import alembic


def _columns(url: str, table: str = "workers") -> set[str]:
    engine = make_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_0012_gives_existing_workers_one_gpu_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0011")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO workers (id, queue, device, max_slots, state, last_heartbeat, registered_at) "
                          "VALUES ('w-old', 'q', 'cuda:0', 8, 'alive', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO packs (id, worker_id, base_model, state, trial_ids, created_at) "
                          "VALUES ('p-old', 'w-old', 'm', 'finished', '[]', CURRENT_TIMESTAMP)"))
    engine.dispose()

    alembic(scratch_url, "upgrade", "0012")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT gpus FROM workers WHERE id = 'w-old'")).scalar_one() == 1
        assert conn.execute(text("SELECT gpus FROM packs WHERE id = 'p-old'")).scalar_one() == 1
        # A row written without the column (the server default stays): one GPU too.
        conn.execute(text("INSERT INTO workers (id, queue, device, max_slots, state, last_heartbeat, registered_at) "
                          "VALUES ('w-new', 'q', 'cuda:0', 8, 'alive', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        assert conn.execute(text("SELECT gpus FROM workers WHERE id = 'w-new'")).scalar_one() == 1
    engine.dispose()

    alembic(scratch_url, "downgrade", "0011")
    assert "gpus" not in _columns(scratch_url) and "gpus" not in _columns(scratch_url, "packs")
    alembic(scratch_url, "upgrade", "head")
    assert "gpus" in _columns(scratch_url) and "gpus" in _columns(scratch_url, "packs")
