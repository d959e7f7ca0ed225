"""Uploaded JSONL datasets of the calling tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, status
from sqlalchemy import select

from api.db import bad_cursor, newest_first
from api.deps import SessionDep, TenantDep
from api.queries import find_file, get_file
from api.schemas.common import ListPage, PathId, error_responses, id_query
from api.schemas.files import FileDeleted, FileOut
from api.services.files import delete_file, upload_file
from api.uploads import request_body
from common.tables import File

router = APIRouter(prefix="/files", tags=["files"], responses=error_responses(401, 404, 422))


# The body is read by the route itself, as it arrives (api/uploads.py), so OpenAPI is told its shape here.
UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "contentMediaType": "application/octet-stream",
                                 "description": "The JSONL dataset."},
                        "purpose": {"type": "string", "const": "fine-tune", "default": "fine-tune"},
                    },
                }
            }
        },
    }
}


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length", "")
    return int(value) if value.isascii() and value.isdigit() else None


@router.post("", status_code=status.HTTP_201_CREATED, responses=error_responses(413, 429), openapi_extra=UPLOAD_FORM)
def create_file(request: Request, tenant: TenantDep, session: SessionDep) -> FileOut:
    """Upload a JSONL dataset (chat `messages` rows or `prompt`/`completion` rows) as multipart/form-data;
    every row is checked as it streams in (a line is at most 1 MiB and nests arrays and objects at most 64 deep;
    422 `invalid_file` lists each bad line). 413: larger than the tenant's `max_file_bytes` or what its
    storage quota has left; 429: the tenant stores `max_files` files already."""
    with request_body(request) as body:  # read only now: after authentication, never before
        row = upload_file(session, tenant=tenant, content_type=request.headers.get("content-type"),
                          content_length=_content_length(request), body=body)
    return FileOut.of(row)


@router.get("")
def list_files(
    tenant: TenantDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, id_query("The id of the last file of the previous page.")] = None,
    sha256: Annotated[str | None, Query(pattern="^[0-9a-f]{64}$", description=(
        "Only the files with this content (the hex SHA-256 of the uploaded bytes, as `sha256` says): a client finds "
        "a file it uploaded before instead of uploading it again."))] = None,
) -> ListPage[FileOut]:
    """This tenant's files, newest first."""
    cursor = None
    if after is not None:
        cursor = find_file(session, tenant_id=tenant.id, file_id=after, include_deleted=True)
        if cursor is None:
            raise bad_cursor("file", after)
    stmt = select(File).where(File.tenant_id == tenant.id, File.deleted_at.is_(None))
    if sha256 is not None:
        stmt = stmt.where(File.sha256 == sha256)
    rows, has_more = newest_first(session, stmt, File, after=cursor, limit=limit)
    return ListPage(data=[FileOut.of(f) for f in rows], has_more=has_more)


@router.get("/{file_id}")
def read_file(file_id: PathId, tenant: TenantDep, session: SessionDep) -> FileOut:
    return FileOut.of(get_file(session, tenant_id=tenant.id, file_id=file_id))


@router.delete("/{file_id}", responses=error_responses(409))
def remove_file(file_id: PathId, tenant: TenantDep, session: SessionDep) -> FileDeleted:
    """Deletes the file's content; refused while a task that has not finished uses it."""
    delete_file(session, tenant=tenant, file_id=file_id)
    return FileDeleted(id=file_id)
