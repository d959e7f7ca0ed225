"""Operator endpoints (admin token) for the base-model registry: register a model directory, edit who may use
it, retire it, restore a retired one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.convertors import Convertor, register_url_convertor

from api.db import commit
from api.deps import AdminDep, SessionDep
from api.errors import ApiError, conflict, invalid, not_found
from api.schemas.base_models import RESTORE_ACTION, AdminModelOut, ModelCreate, ModelUpdate
from api.schemas.common import ListPage, PathId, error_responses
from common.architectures import ModelDirError, inspect_gguf, inspect_model_dir
from common.states import TASK_QUEUED, TASK_RUNNING, TASK_VALIDATING
from common.tables import BaseModelEntry, Task, Tenant, utcnow


class _ModelName(Convertor[str]):
    """A model's name in a path: slashes included (hub-style ids), but not ending in /restore, so that GET, PATCH
    and DELETE of `.../{name}/restore` are a 405 (that path is the restore action's, POST only) rather than calls on
    a model named `{name}/restore` (a name registration refuses)."""

    regex = f"(?:(?!{RESTORE_ACTION}$).)*"  # any character but the slash that starts a final /restore

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_name", _ModelName())

router = APIRouter(
    prefix="/admin/models", tags=["admin"], dependencies=[AdminDep], responses=error_responses(401, 403, 404, 422)
)

# A task in one of these states may still load the model: the entry must stay.
_USING_STATES = (TASK_VALIDATING, TASK_QUEUED, TASK_RUNNING)


def _model(session: Session, name: str, *, lock: bool = False) -> BaseModelEntry:
    """The entry; a retired one (deleted_at set) reads as missing."""
    entry = session.get(BaseModelEntry, name, with_for_update={"key_share": True} if lock else None,
                        populate_existing=lock)
    if entry is None or entry.deleted_at is not None:
        raise not_found("model", name)
    return entry


def _name_taken(name: str) -> ApiError:
    return conflict("model_exists", f"A model named '{name}' already exists.", param="name")


def _tenant_ids(session: Session, tenants: list[str] | None) -> list[str] | None:
    """The ids without repeats, each an existing tenant (else a 422 naming the first unknown one)."""
    if tenants is None:
        return None
    unique = list(dict.fromkeys(tenants))
    known = set(session.scalars(select(Tenant.id).where(Tenant.id.in_(unique), Tenant.deleted_at.is_(None)))
                ) if unique else set()
    for index, tenant_id in enumerate(tenants):
        if tenant_id not in known:
            raise invalid(f"No tenant with id '{tenant_id}'.", param=f"tenants[{index}]", code="unknown_tenant")
    return unique


@dataclass(frozen=True)
class _Inspected:
    """What the model's files say (None: not known)."""

    architecture: str | None
    max_context: int | None
    chat_template: bool | None
    parameters: int | None = None


def _inspect(kind: str, path: str, file: str | None) -> _Inspected:
    """Check the files at `path` (a 422 naming what is wrong) and describe them."""
    if kind == "gguf":
        if file is None:
            raise invalid("A gguf model needs `file`: the name of the GGUF file in `path`.", param="file",
                          code="missing_field")
        gguf = Path(path) / file
        if not gguf.is_file():
            raise invalid(f"{gguf} does not exist or is not a file.", param="file", code="model_file_not_found")
        try:
            header = inspect_gguf(gguf)
        except ModelDirError as exc:
            raise invalid(exc.message, param="file", code=exc.code) from exc
        return _Inspected(header.architecture, header.max_context, header.has_chat_template)
    if file is not None:
        raise invalid("`file` is only for kind gguf.", param="file", code="unknown_field")
    try:
        info = inspect_model_dir(path)
    except ModelDirError as exc:
        raise invalid(exc.message, param="path", code=exc.code) from exc
    return _Inspected(info.architecture, info.max_context, info.has_chat_template, info.parameters)


def _describe(entry: BaseModelEntry, inspected: _Inspected) -> None:
    entry.architecture = inspected.architecture
    entry.max_context = inspected.max_context
    entry.chat_template = inspected.chat_template
    entry.parameters = inspected.parameters


@router.post("", status_code=status.HTTP_201_CREATED, responses=error_responses(409))
def register_model(body: ModelCreate, session: SessionDep) -> AdminModelOut:
    """Register a model directory (config.json of a supported architecture, safetensors weights, tokenizer) or,
    with kind gguf, a GGUF file in a directory. `path` is where the workers find it. The name of a retired model
    may be registered again: the new entry replaces the retired one."""
    # Locked: two registrations of one retired name do not both replace it.
    entry = session.get(BaseModelEntry, body.name, with_for_update={"key_share": True}, populate_existing=True)
    if entry is not None and entry.deleted_at is None:
        raise _name_taken(body.name)
    tenants = _tenant_ids(session, body.tenants)
    inspected = _inspect(body.kind, body.path, body.file)
    if entry is None:
        entry = BaseModelEntry(name=body.name)
        session.add(entry)
    # Every field, so nothing of a retired entry this one replaces is left over.
    entry.kind, entry.path, entry.gguf_file, entry.package = body.kind, body.path, body.file, None
    entry.quantization = body.quantization
    entry.description, entry.tenants = body.description, tenants
    _describe(entry, inspected)
    entry.created_at, entry.updated_at, entry.deleted_at = utcnow(), None, None
    commit(session, conflict_code="model_exists", conflict_message=f"A model named '{body.name}' already exists.")
    return AdminModelOut.of(entry)


@router.get("")
def list_registered_models(
    session: SessionDep,
    include_deleted: Annotated[bool, Query(description="Also the retired entries (deleted_at set).")] = False,
) -> ListPage[AdminModelOut]:
    """Every entry of the registry, whoever may use it, by name; retired ones only with include_deleted."""
    stmt = select(BaseModelEntry).order_by(BaseModelEntry.name)
    if not include_deleted:
        stmt = stmt.where(BaseModelEntry.deleted_at.is_(None))
    return ListPage(data=[AdminModelOut.of(m) for m in session.scalars(stmt)])


@router.post("/{name:path}/restore", responses=error_responses(409))
def restore_registered_model(name: PathId, session: SessionDep) -> AdminModelOut:
    """Bring a retired model back (built-in ones too: the API's start never seeds a retired built-in again), as it
    was when retired. The files of a registered directory or GGUF file are checked again as registration checks
    them (a 422 naming what is wrong, and it stays retired). 404 for a name never registered; 409 `model_exists`
    while a live model holds the name (it was never retired, or was registered again since). The scheduler
    publishes the registry to the workers again at its next round, as after any change."""
    # Locked, as registration and retirement lock it: a restore and a re-registration of one name do not both win.
    entry = session.get(BaseModelEntry, name, with_for_update={"key_share": True}, populate_existing=True)
    if entry is None:
        raise not_found("model", name)
    if entry.deleted_at is None:
        raise conflict("model_exists", f"A live model named '{name}' exists; there is nothing to restore.")
    if entry.kind in ("hf", "gguf") and entry.path is not None:
        _describe(entry, _inspect(entry.kind, entry.path, entry.gguf_file))
    entry.deleted_at, entry.updated_at = None, utcnow()
    commit(session)
    return AdminModelOut.of(entry)


@router.get("/{name:model_name}")
def get_registered_model(name: PathId, session: SessionDep) -> AdminModelOut:
    """A retired model is a 404."""
    return AdminModelOut.of(_model(session, name))


@router.patch("/{name:model_name}")
def update_registered_model(name: PathId, body: ModelUpdate, session: SessionDep) -> AdminModelOut:
    """`description`, and `tenants` (null: every tenant). The files of a registered directory or GGUF file are
    read again (architecture, max_context, chat_template are refreshed; `{}` does only that), with the checks of
    registration: a 422 naming what is wrong, and nothing changed. Tasks already submitted keep running."""
    entry = _model(session, name, lock=True)
    changes = body.model_dump(exclude_unset=True)
    tenants = _tenant_ids(session, changes["tenants"]) if "tenants" in changes else entry.tenants
    if entry.kind in ("hf", "gguf") and entry.path is not None:
        _describe(entry, _inspect(entry.kind, entry.path, entry.gguf_file))
    if "description" in changes and changes["description"] is not None:
        entry.description = changes["description"]
    entry.tenants = tenants
    entry.updated_at = utcnow()
    commit(session)
    return AdminModelOut.of(entry)


@router.delete("/{name:model_name}", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(409))
def delete_registered_model(name: PathId, session: SessionDep) -> Response:
    """Retire the model: refused (409 `model_in_use`) while a validating, queued or running task uses it;
    otherwise the entry is kept (finished tasks still name it) but hidden: not listed, a 404 here, unknown to task
    submission; its name may be registered again. Built-in models too (they are not seeded again)."""
    # Locked, so that no task is submitted for it between the check and the retirement (submission locks it
    # FOR SHARE and reads deleted_at after the lock).
    entry = _model(session, name, lock=True)
    active = session.scalar(select(func.count()).select_from(Task).where(
        Task.base_model == entry.name, Task.state.in_(_USING_STATES)))
    if active:
        raise conflict("model_in_use", f"{active} validating, queued or running task(s) use model '{entry.name}'; "
                       "delete it once they have finished or been cancelled.")
    entry.deleted_at = utcnow()
    commit(session)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
