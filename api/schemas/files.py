"""Uploaded datasets."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from api.schemas.common import UtcDateTime
from common.tables import File


class FileOut(BaseModel):
    id: str
    object: Literal["file"] = "file"
    filename: str
    purpose: str
    bytes: int
    rows: int
    format: str
    sha256: str
    created_at: UtcDateTime
    # OpenAI's client reads it: a file is stored only once every row validated, so every file listed is processed.
    status: Literal["processed"] = "processed"

    @classmethod
    def of(cls, f: File) -> FileOut:
        return cls(
            id=f.id, filename=f.filename, purpose=f.purpose, bytes=f.bytes, rows=f.rows, format=f.format,
            sha256=f.sha256, created_at=f.created_at,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True
