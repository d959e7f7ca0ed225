"""Request-scoped sessions, the one commit helper, and newest-first cursor paging.

A request's session never commits by itself: services call `commit()` once, after everything was
validated, so a request that fails at any point leaves nothing behind (closing rolls back).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.errors import ApiError, conflict, invalid
from common.db import get_engine

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100


@lru_cache
def session_factory() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


def get_session() -> Iterator[Session]:
    with session_factory()() as session:
        yield session


def commit(session: Session, *, conflict_code: str = "conflict", conflict_message: str | None = None) -> None:
    """Commit, turning a constraint violation into a 409 (the session is rolled back either way)."""
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise conflict(conflict_code, conflict_message or "The request conflicts with the current state.") from exc
    except BaseException:
        session.rollback()
        raise


def newest_first(
    session: Session, stmt: Select[T], model: Any, *, after: Any | None, limit: int
) -> tuple[Sequence[T], bool]:
    """One page of `stmt` ordered newest first; `after` is the row the previous page ended with.

    Ties on created_at are broken by id, so pages never skip or repeat a row.
    Returns (rows, has_more).
    """
    if after is not None:
        stmt = stmt.where(
            or_(
                model.created_at < after.created_at,
                and_(model.created_at == after.created_at, model.id < after.id),
            )
        )
    rows = session.scalars(stmt.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)).all()
    return rows[:limit], len(rows) > limit


def bad_cursor(kind: str, object_id: str) -> ApiError:
    return invalid(f"No {kind} with id '{object_id}' to page after.", param="after", code="invalid_cursor")
