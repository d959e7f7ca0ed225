"""Operator endpoints (admin token) for the base-model registry: register a model directory, edit who may use
it, retire it."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Response, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.db import commit
from api.deps import AdminDep, SessionDep
from api.errors import ApiError, conflict, invalid, not_found
from api.schemas.common import ListPage, PathId, error_responses
from api.schemas.models import AdminModelOut, ModelCreate, ModelUpdate
from common.architectures import ModelDirError, inspect_model_dir
from common.models import BaseModelEntry, Task, Tenant, utcnow
from common.states import TASK_QUEUED, TASK_RUNNING, TASK_VALIDATING

router = APIRouter(
    prefix="/admin/models", tags=["admin"], dependencies=[AdminDep], responses=error_responses(401, 403, 404, 422)
)

# A task in one of these states may still load the model: the entry must stay.
_USING_STATES = (TASK_VALIDATING, TASK_QUEUED, TASK_RUNNING)


def _model(session: Session, name: str) -> BaseModelEntry:
    entry = session.get(BaseModelEntry, name)
    if entry is None:
        raise not_found("model", name)
    return entry


def _name_taken(name: str) -> ApiError:
    return conflict("model_exists", f"A model named '{name}' already exists.", param="name")


def _tenant_ids(session: Session, tenants: list[str] | None) -> list[str] | None:
    """The ids without repeats, each an existing tenant (else a 422 naming the first unknown one)."""
    if tenants is None:
        return None
    unique = list(dict.fromkeys(tenants))
    known = set(session.scalars(select(Tenant.id).where(Tenant.id.in_(unique)))) if unique else set()
    for index, tenant_id in enumerate(tenants):
        if tenant_id not in known:
            raise invalid(f"No tenant with id '{tenant_id}'.", param=f"tenants[{index}]", code="unknown_tenant")
    return unique


def _inspected(body: ModelCreate) -> BaseModelEntry:
    """The entry for the request, after checking the files at `path` (a 422 naming what is wrong)."""
    if body.kind == "gguf":
        if body.file is None:
            raise invalid("A gguf model needs `file`: the name of the GGUF file in `path`.", param="file",
                          code="missing_field")
        gguf = Path(body.path) / body.file
        if not gguf.is_file():
            raise invalid(f"{gguf} does not exist or is not a file.", param="file", code="model_file_not_found")
        return BaseModelEntry(name=body.name, kind="gguf", path=body.path, gguf_file=body.file,
                              description=body.description)
    if body.file is not None:
        raise invalid("`file` is only for kind gguf.", param="file", code="unknown_field")
    try:
        info = inspect_model_dir(body.path)
    except ModelDirError as exc:
        raise invalid(exc.message, param="path", code=exc.code) from exc
    return BaseModelEntry(name=body.name, kind="hf", path=body.path, description=body.description,
                          architecture=info.architecture, max_context=info.max_context)


@router.post("", status_code=status.HTTP_201_CREATED, responses=error_responses(409))
def register_model(body: ModelCreate, session: SessionDep) -> AdminModelOut:
    """Register a model directory (config.json of a supported architecture, safetensors weights, tokenizer) or,
    with kind gguf, a GGUF file in a directory. `path` is where the workers find it."""
    if session.get(BaseModelEntry, body.name) is not None:
        raise _name_taken(body.name)
    tenants = _tenant_ids(session, body.tenants)
    entry = _inspected(body)
    entry.tenants = tenants
    entry.created_at = utcnow()
    session.add(entry)
    commit(session, conflict_code="model_exists", conflict_message=f"A model named '{body.name}' already exists.")
    return AdminModelOut.of(entry)


@router.get("")
def list_registered_models(session: SessionDep) -> ListPage[AdminModelOut]:
    """Every entry of the registry, whoever may use it, by name."""
    entries = session.scalars(select(BaseModelEntry).order_by(BaseModelEntry.name))
    return ListPage(data=[AdminModelOut.of(m) for m in entries])


@router.get("/{name:path}")
def get_registered_model(name: PathId, session: SessionDep) -> AdminModelOut:
    return AdminModelOut.of(_model(session, name))


@router.patch("/{name:path}")
def update_registered_model(name: PathId, body: ModelUpdate, session: SessionDep) -> AdminModelOut:
    """`description`, and `tenants` (null: every tenant). Tasks already submitted keep running."""
    entry = _model(session, name)
    changes = body.model_dump(exclude_unset=True)
    if "description" in changes and changes["description"] is not None:
        entry.description = changes["description"]
    if "tenants" in changes:
        entry.tenants = _tenant_ids(session, changes["tenants"])
    entry.updated_at = utcnow()
    commit(session)
    return AdminModelOut.of(entry)


@router.delete("/{name:path}", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(409))
def delete_registered_model(name: PathId, session: SessionDep) -> Response:
    """Refused (409) while a task that is not finished uses the model, and while finished tasks still refer to it
    (restrict it with `tenants: []` instead to retire it)."""
    entry = _model(session, name)
    # Lock the entry so that no task is submitted for it between the check and the delete.
    session.execute(select(BaseModelEntry.name).where(BaseModelEntry.name == entry.name).with_for_update())
    active = session.scalar(select(func.count()).select_from(Task).where(
        Task.base_model == entry.name, Task.state.in_(_USING_STATES)))
    if active:
        raise conflict("model_in_use", f"{active} queued or running task(s) use model '{entry.name}'; "
                       "delete it once they have finished or been cancelled.")
    finished = session.scalar(select(func.count()).select_from(Task).where(Task.base_model == entry.name))
    if finished:
        raise conflict("model_has_tasks", f"{finished} finished task(s) refer to model '{entry.name}'; "
                       "restrict it with tenants [] to retire it.")
    session.delete(entry)
    commit(session, conflict_code="model_in_use", conflict_message=f"Tasks refer to model '{entry.name}'.")
    return Response(status_code=status.HTTP_204_NO_CONTENT)
