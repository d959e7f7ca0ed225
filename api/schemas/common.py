"""Shapes shared by every resource: timestamps, list pages, the error body."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, PlainSerializer

T = TypeVar("T")


def iso_utc(value: datetime) -> str:
    """ISO-8601 in UTC with a 'Z' (SQLite hands back naive datetimes, which we always store as UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


UtcDateTime = Annotated[datetime, PlainSerializer(iso_utc, return_type=str)]


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


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
