"""Uploading and deleting datasets. Content goes to the artifact store, metadata to the database."""

from __future__ import annotations

import hashlib
import logging
from typing import BinaryIO

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from api.db import commit
from api.errors import INVALID_REQUEST, ApiError, conflict, invalid
from api.queries import get_file
from common.artifacts import file_key, get_artifact_store
from common.datasets import validate_jsonl
from common.models import File, Task, Tenant, new_id, utcnow
from common.states import TASK_FINAL

log = logging.getLogger(__name__)

MAX_FILENAME = 300


def clean_filename(name: str | None) -> str:
    """The last path component only (browsers and curl may send a full path), at most 300 characters."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1].strip()
    return base[-MAX_FILENAME:] or "upload.jsonl"


def upload_file(session: Session, *, tenant: Tenant, content: BinaryIO, filename: str | None, purpose: str) -> File:
    """Validates the whole file first; stores it; inserts the row; removes the stored copy if that fails."""
    limit = tenant.max_file_bytes
    data = content.read(limit + 1)
    if len(data) > limit:
        raise ApiError(
            413, INVALID_REQUEST, "file_too_large",
            f"The file is larger than this tenant's limit of {limit} bytes.", param="file",
        )
    report = validate_jsonl(data)
    if not report.ok:
        first = report.errors[0]
        where = f"line {first.line}: " if first.line else ""
        raise invalid(
            f"The file is not valid training data ({report.error_count} problem(s)); first: {where}{first.message}",
            param="file", code="invalid_file",
            errors=[{"line": e.line, "message": e.message} for e in report.errors],
            error_count=report.error_count,
        )
    assert report.format is not None
    file_id = new_id("file")
    key = file_key(file_id)
    file = File(
        id=file_id, tenant_id=tenant.id, filename=clean_filename(filename), purpose=purpose, bytes=len(data),
        rows=report.rows, format=report.format, sha256=hashlib.sha256(data).hexdigest(), storage_key=key,
        created_at=utcnow(),
    )
    store = get_artifact_store()
    store.put_bytes(key, data)
    try:
        session.add(file)
        commit(session)
    except BaseException:
        store.delete(key)  # no orphan content for a row that never existed
        raise
    return file


def delete_file(session: Session, *, tenant: Tenant, file_id: str) -> None:
    """Marks the file deleted and removes its content, unless a task that has not finished uses it."""
    file = get_file(session, tenant_id=tenant.id, file_id=file_id, lock="update")  # no task can claim it meanwhile
    user = session.scalar(
        select(Task.id)
        .where(
            Task.tenant_id == tenant.id,
            Task.state.not_in(TASK_FINAL),
            or_(Task.training_file_id == file.id, Task.validation_file_id == file.id),
        )
        .limit(1)
    )
    if user is not None:
        raise conflict("file_in_use", f"File '{file.id}' is used by task '{user}', which has not finished.")
    file.deleted_at = utcnow()
    commit(session)
    try:  # after the commit: a failed request must never leave a live row without its content
        get_artifact_store().delete(file.storage_key)
    except OSError:
        log.warning("could not remove the content of deleted file %s", file.id, exc_info=True)
