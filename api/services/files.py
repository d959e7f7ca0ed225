"""Uploading and deleting datasets. Content goes to the artifact store, metadata to the database.

An upload streams: each piece of the file, as it arrives (`api/uploads.py`), is written to a staged object
in the artifact store, hashed and validated line by line, so one upload holds a piece and a line at most
in memory (a line is at most `MAX_LINE_BYTES`) whatever its size and however many run at once. Limits hold
as the bytes arrive: the tenant's `max_file_bytes` and what is left of its storage quota (413), and no
upload starts past its file quota (429). The quota is checked again, under a lock on the tenant's row,
just before the file's row is inserted, so concurrent uploads cannot overshoot it together.
"""

from __future__ import annotations

import hashlib
import logging
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from api.db import commit
from api.deps import invalid_api_key
from api.errors import INVALID_REQUEST, RATE_LIMIT, ApiError, conflict, invalid
from api.queries import get_file
from api.uploads import FormEvent, PartStart, form_events, multipart_boundary
from common.artifacts import StagedObject, file_key, get_artifact_store
from common.datasets import DatasetReport, JsonlValidator
from common.states import TASK_FINAL
from common.tables import Checkpoint, File, Task, Tenant, new_id, utcnow

log = logging.getLogger(__name__)

MAX_FILENAME = 300
# What a request body may carry beyond the file itself: the multipart framing and the small fields beside it.
FORM_OVERHEAD_BYTES = 64 * 1024
PURPOSES = ("fine-tune",)
MAX_PURPOSE_BYTES = 64


def clean_filename(name: str | None) -> str:
    """The last path component only (browsers and curl may send a full path), without control characters
    (NUL, terminal escapes), at most 300 characters."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(ch for ch in base if unicodedata.category(ch) != "Cc").strip()
    return base[-MAX_FILENAME:] or "upload.jsonl"


@dataclass(frozen=True)
class StorageUsage:
    files: int
    bytes: int  # the live files' and the kept checkpoints' together: what the storage quota bounds


def storage_usage(session: Session, tenant_id: str) -> StorageUsage:
    """What the tenant's live (not deleted) files and its trials' kept checkpoints take."""
    files, used = session.execute(
        select(func.count(), func.coalesce(func.sum(File.bytes), 0))
        .where(File.tenant_id == tenant_id, File.deleted_at.is_(None))
    ).one()
    checkpoints = session.scalar(select(func.coalesce(func.sum(Checkpoint.size_bytes), 0))
                                 .where(Checkpoint.tenant_id == tenant_id))
    return StorageUsage(files=int(files), bytes=int(used) + int(checkpoints or 0))


def _storage_quota_exceeded(limit: int, usage: StorageUsage) -> ApiError:
    return ApiError(
        413, INVALID_REQUEST, "storage_quota_exceeded",
        f"The upload would take this tenant's stored bytes past its storage quota of {limit} bytes "
        f"({usage.bytes} bytes stored: {usage.files} file(s) and the trials' checkpoints); delete files to make "
        "room.",
        param="file", limit=limit, usage=usage.bytes,
    )


def _file_quota_exceeded(limit: int, usage: StorageUsage) -> ApiError:
    return ApiError(
        429, RATE_LIMIT, "file_quota_exceeded",
        f"This tenant stores {usage.files} file(s) and may store {limit}; delete a file to upload another.",
        param="file", limit=limit, usage=usage.files,
    )


def _file_too_large(limit: int) -> ApiError:
    return ApiError(
        413, INVALID_REQUEST, "file_too_large", f"The file is larger than this tenant's limit of {limit} bytes.",
        param="file", limit=limit,
    )


def _upload_limit(tenant: Tenant, usage: StorageUsage) -> tuple[int, ApiError]:
    """The most bytes this upload may have, and the error for one past it; raises if none may start."""
    if usage.files >= tenant.max_files:
        raise _file_quota_exceeded(tenant.max_files, usage)
    room = tenant.max_storage_bytes - usage.bytes
    if room <= 0:
        raise _storage_quota_exceeded(tenant.max_storage_bytes, usage)
    if room < tenant.max_file_bytes:
        return room, _storage_quota_exceeded(tenant.max_storage_bytes, usage)
    return tenant.max_file_bytes, _file_too_large(tenant.max_file_bytes)


def _form_error(param: str, code: str, message: str) -> ApiError:
    """The answer FastAPI's own form validation gave (the one shape, with its `errors` list)."""
    return invalid(f"{param}: {message}", param=param, code=code,
                   errors=[{"param": param, "code": code, "message": message}])


def _capped(body: Iterable[bytes], cap: int, too_large: ApiError) -> Iterator[bytes]:
    received = 0
    for piece in body:
        received += len(piece)
        if received > cap:
            raise too_large
        yield piece


@dataclass(frozen=True)
class _Received:
    filename: str | None
    purpose: str
    sha256: str
    report: DatasetReport


def _receive(events: Iterable[FormEvent], staged: StagedObject, limit: int, too_large: ApiError) -> _Received:
    """Reads the whole form: the `file` part into `staged` (hashed and validated as it goes), `purpose`;
    other fields are read and dropped, as FastAPI's form handling dropped them."""
    digest = hashlib.sha256()
    validator = JsonlValidator()
    part: PartStart | None = None
    file_part: PartStart | None = None
    purpose: bytearray | None = None
    for event in events:
        if isinstance(event, PartStart):
            part = event
            if part.name == "file":
                if file_part is not None:
                    raise _form_error("file", "invalid_value", "send one file per upload")
                file_part = part
            elif part.name == "purpose":
                purpose = bytearray()
        elif file_part is not None and part is file_part:
            if staged.size + len(event) > limit:
                raise too_large
            staged.write(event)
            digest.update(event)
            validator.feed(event)
        elif part is not None and part.name == "purpose" and purpose is not None:
            purpose += event
            if len(purpose) > MAX_PURPOSE_BYTES:
                raise _form_error("purpose", "invalid_value", f"Input should be one of {list(PURPOSES)}")
    if file_part is None:
        raise _form_error("file", "missing_field", "Field required")
    purpose_text = PURPOSES[0] if purpose is None else purpose.decode("utf-8", errors="replace")
    if purpose_text not in PURPOSES:
        raise _form_error("purpose", "invalid_value", f"Input should be one of {list(PURPOSES)}")
    return _Received(file_part.filename, purpose_text, digest.hexdigest(), validator.finish())


def _check_report(report: DatasetReport) -> None:
    if report.ok:
        return
    first = report.errors[0]
    where = f"line {first.line}: " if first.line else ""
    raise invalid(
        f"The file is not valid training data ({report.error_count} problem(s)); first: {where}{first.message}",
        param="file", code="invalid_file",
        errors=[{"line": e.line, "message": e.message} for e in report.errors],
        error_count=report.error_count,
    )


def upload_file(
    session: Session, *, tenant: Tenant, content_type: str | None, content_length: int | None,
    body: Iterable[bytes],
) -> File:
    """Streams a multipart upload into the store, validating it; inserts its row if it fits the quota.

    Nothing survives a refusal or a failure: the staged object is removed, or the published one when the
    insert fails."""
    boundary = multipart_boundary(content_type)
    if boundary is None:
        raise _form_error("file", "missing_field", "Field required (upload it as multipart/form-data)")
    limit, too_large = _upload_limit(tenant, storage_usage(session, tenant.id))
    # The transfer may take minutes: hold no database connection (on SQLite, no read snapshot) meanwhile.
    session.commit()
    body_cap = limit + FORM_OVERHEAD_BYTES
    if content_length is not None and content_length > body_cap:
        raise too_large  # before reading any of it
    file_id = new_id("file")
    store = get_artifact_store()
    staged = store.stage(file_key(file_id))
    try:
        received = _receive(form_events(boundary, _capped(body, body_cap, too_large)), staged, limit, too_large)
        _check_report(received.report)
        assert received.report.format is not None
        staged.sync()  # the slow part of publishing, done before the tenant's row is locked
        # Locking the tenant's row serialises this last check between concurrent uploads of one tenant, and
        # against the tenant's deletion (api/services/tenants.py), which takes the same lock.
        quota = session.execute(select(Tenant.max_storage_bytes, Tenant.max_files, Tenant.deleted_at)
                                .where(Tenant.id == tenant.id).with_for_update(key_share=True)).one()
        if quota.deleted_at is not None:
            raise invalid_api_key()
        usage = storage_usage(session, tenant.id)
        if usage.files + 1 > quota.max_files:
            raise _file_quota_exceeded(quota.max_files, usage)
        if usage.bytes + staged.size > quota.max_storage_bytes:
            raise _storage_quota_exceeded(quota.max_storage_bytes, usage)
        file = File(
            id=file_id, tenant_id=tenant.id,
            filename=clean_filename(received.filename), purpose=received.purpose, bytes=staged.size,
            rows=received.report.rows, format=received.report.format, sha256=received.sha256,
            storage_key=staged.key, created_at=utcnow(),
        )
        session.add(file)
        staged.publish()
    except BaseException:
        staged.discard()
        raise
    try:
        commit(session)
    except BaseException:
        store.delete(file.storage_key)  # no orphan content for a row that never existed
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
