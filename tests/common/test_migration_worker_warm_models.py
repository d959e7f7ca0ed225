"""Revision 0016 (warm models) gives existing workers no warm model until their next heartbeat says, and downgrades
cleanly, on SQLite and on Postgres."""

from __future__ import annotations

import json

from sqlalchemy import text

from common.db import make_engine
from tests.common.conftest import alembic, table_columns


def test_0016_starts_every_worker_with_no_warm_model_said_and_downgrades(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0015")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO workers (id, queue, device, max_slots, state, last_heartbeat, registered_at) "
                          "VALUES ('w-old', 'q', 'cuda:0', 8, 'alive', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
    engine.dispose()

    alembic(scratch_url, "upgrade", "0016")
    engine = make_engine(scratch_url)
    warm = [{"name": "m", "revision": "r", "bytes": 1, "last_used_at": 1.5}]
    with engine.begin() as conn:
        assert conn.execute(text("SELECT warm_models FROM workers WHERE id = 'w-old'")).one() == (None,)
        conn.execute(text("UPDATE workers SET warm_models = :warm WHERE id = 'w-old'"), {"warm": json.dumps(warm)})
        stored = conn.execute(text("SELECT warm_models FROM workers WHERE id = 'w-old'")).scalar_one()
        assert (json.loads(stored) if isinstance(stored, str) else stored) == warm
    engine.dispose()

    alembic(scratch_url, "downgrade", "0015")
    assert "warm_models" not in table_columns(scratch_url, "workers")
    alembic(scratch_url, "upgrade", "head")
    assert "warm_models" in table_columns(scratch_url, "workers")
