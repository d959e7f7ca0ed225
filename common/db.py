"""Engine, sessions and migrations. One engine per process; sessions are short-lived units of work."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from common.private_files import private_sqlite_file
from common.settings import get_settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


# Connections per process. Each API process runs its routes in anyio's 40 worker threads, so up to 40 can
# want one at once; a thread that finds none waits for one (never while holding another: api/deps.py).
# SQLite's cost nothing to keep and more than a query to open (the PRAGMAs below), so the pool keeps them all.
# Postgres's are server processes: 10 kept and 10 more at a peak, plus the autocommit pool's 10, keep
# `loraplane api --workers 2` (60), the scheduler and a few clients under the server's default 100.
SQLITE_POOL = {"pool_size": 40, "max_overflow": 10}
POSTGRES_POOL = {"pool_size": 10, "max_overflow": 10}
# The API's status reads run at most 8 at once (api/routes/tasks.py) and its SSE watch one: never more.
AUTOCOMMIT_POOL = {"pool_size": 10, "max_overflow": 0}


def make_engine(url: str, *, autocommit: bool = False) -> Engine:
    options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            private_sqlite_file(Path(path))  # the database holds every tenant's data: its owner's alone
        pool = AUTOCOMMIT_POOL if autocommit else SQLITE_POOL
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool, **options)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # WAL lets the API read while the scheduler writes; foreign keys are off by default in SQLite.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    pool = AUTOCOMMIT_POOL if autocommit else POSTGRES_POOL
    return create_engine(url, pool_pre_ping=True, **pool, **options)


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().resolved_database_url)


@lru_cache
def get_autocommit_engine() -> Engine:
    """The same database with connections in autocommit, for reads that need no transaction (the API's status
    reads and SSE watch): each statement sees what is committed, as in a READ COMMITTED transaction, without
    the BEGIN and ROLLBACK round trips around it. A pool of its own: the mode is set once per connection,
    not on every checkout."""
    return make_engine(get_settings().resolved_database_url, autocommit=True)


@lru_cache
def _session_factory() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


def transaction_memo(session: Session, key: str) -> dict[Any, Any]:
    """A dict kept in ``session.info`` under ``key`` for the session's current transaction only: what a transaction
    read or took once (an advisory lock, a tenant's webhook endpoints) and must not carry into the next one."""
    transaction = session.get_transaction()
    owner, memo = session.info.get(key, (None, {}))
    if owner is not transaction:
        memo = {}
        session.info[key] = (transaction, memo)
    return memo


@contextmanager
def session_scope() -> Iterator[Session]:
    """A unit of work: commits on success, rolls back on any error so nothing half-written survives."""
    session = _session_factory()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def migrate(url: str | None = None) -> None:
    """Bring the schema to the newest revision (idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", (url or get_settings().resolved_database_url).replace("%", "%%"))
    command.upgrade(cfg, "head")
