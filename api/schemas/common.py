"""Shapes shared by every resource: timestamps, list pages, the error body, and the bounds every request
value is checked against (integer ranges of the database columns, finite numbers, text without control
characters)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from fastapi import Path, Query
from pydantic import AllowInfNan, BaseModel, ConfigDict, PlainSerializer, Strict, StringConstraints

from common.tables import as_utc

T = TypeVar("T")

# The ranges of the database's integer columns: a larger number in a query is a 422, never a database error
# (Postgres: "integer out of range") or a stream cut off half-way.
INT32_MAX = 2**31 - 1  # INTEGER columns: steps, counts
INT64_MAX = 2**63 - 1  # BIGINT columns: event ids, byte sizes

# Text a request may carry has no control characters: C0 (NUL, which Postgres cannot store; ESC, which starts
# an ANSI escape sequence; bell; line breaks), DEL and C1. A name or id is shown in terminals and logs.
NO_CONTROL_CHARS = r"^[^\x00-\x1f\x7f-\x9f]*$"
Text = Annotated[str, StringConstraints(pattern=NO_CONTROL_CHARS)]

# JSON numbers where numbers are meant: `true` and "1" are refused, an integer is fine where a float is meant,
# and Infinity/NaN (which Python's JSON parser turns `Infinity`, `NaN` and `1e400` into) are refused: they are
# not JSON, so SQLite would store invalid JSON and Postgres refuses them. RequestModel applies the same rules
# to every field; these types carry them into values validated outside a model (search-space lists).
FiniteFloat = Annotated[float, Strict(), AllowInfNan(False)]

# Ids in paths and queries are short, printable text; anything else is a 422 before the database sees it.
ID_MAX_LENGTH = 200
PathId = Annotated[str, Path(max_length=ID_MAX_LENGTH, pattern=NO_CONTROL_CHARS)]


def id_query(description: str) -> Any:
    """A query parameter that names an object (a page cursor): the same rules as PathId."""
    return Query(max_length=ID_MAX_LENGTH, pattern=NO_CONTROL_CHARS, description=description)


def iso_utc(value: datetime) -> str:
    """ISO-8601 in UTC with a 'Z' (SQLite hands back naive datetimes, which we always store as UTC)."""
    return as_utc(value).astimezone(UTC).isoformat().replace("+00:00", "Z")


UtcDateTime = Annotated[datetime, PlainSerializer(iso_utc, return_type=str)]


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are an error, not silently dropped; numbers and booleans are
    strict JSON types (`true` is no quota, "5" no count, 1 is a fine float) and floats are finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ListPage(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    code: str
    message: str
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries documenting our error body for the given status codes."""
    return {code: {"model": ErrorResponse} for code in codes}
