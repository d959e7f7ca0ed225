"""Uploaded JSONL datasets of the calling tenant."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, UploadFile, status
from sqlalchemy import select

from api.db import bad_cursor, newest_first
from api.deps import SessionDep, TenantDep
from api.queries import find_file, get_file
from api.schemas.common import ListPage, error_responses
from api.schemas.files import FileDeleted, FileOut
from api.services.files import delete_file, upload_file
from common.models import File

router = APIRouter(prefix="/files", tags=["files"], responses=error_responses(401, 404, 422))


@router.post("", status_code=status.HTTP_201_CREATED, responses=error_responses(413))
def create_file(
    tenant: TenantDep,
    session: SessionDep,
    file: UploadFile,
    purpose: Annotated[Literal["fine-tune"], Form()] = "fine-tune",
) -> FileOut:
    """Upload a JSONL dataset (chat `messages` rows or `prompt`/`completion` rows); every row is checked."""
    row = upload_file(session, tenant=tenant, content=file.file, filename=file.filename, purpose=purpose)
    return FileOut.of(row)


@router.get("")
def list_files(
    tenant: TenantDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="The id of the last file of the previous page.")] = None,
) -> ListPage[FileOut]:
    """This tenant's files, newest first."""
    cursor = None
    if after is not None:
        cursor = find_file(session, tenant_id=tenant.id, file_id=after, include_deleted=True)
        if cursor is None:
            raise bad_cursor("file", after)
    stmt = select(File).where(File.tenant_id == tenant.id, File.deleted_at.is_(None))
    rows, has_more = newest_first(session, stmt, File, after=cursor, limit=limit)
    return ListPage(data=[FileOut.of(f) for f in rows], has_more=has_more)


@router.get("/{file_id}")
def read_file(file_id: str, tenant: TenantDep, session: SessionDep) -> FileOut:
    return FileOut.of(get_file(session, tenant_id=tenant.id, file_id=file_id))


@router.delete("/{file_id}", responses=error_responses(409))
def remove_file(file_id: str, tenant: TenantDep, session: SessionDep) -> FileDeleted:
    """Deletes the file's content; refused while a task that has not finished uses it."""
    delete_file(session, tenant=tenant, file_id=file_id)
    return FileDeleted(id=file_id)
