"""Sampling from trained adapters (issue 35): a trial's completion, the task's best trial's, and OpenAI's chat
completions where `model` names a task, a trial or a base model. Answered by the workers' samplers
(api/services/completions.py says how; worker/sampler.py does it). A tenant's key only: the admin token reads, it
does not sample. A request in flight is cut off (401 `api_key_revoked`) once its key is revoked or its tenant deleted
(api/services/completions.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from sqlalchemy.orm import Session

from api.deps import CallerDep, SessionDep
from api.schemas.common import PathId, error_responses
from api.schemas.completions import ChatCompletionRequest, CompletionRequest
from api.services.completions import Target, complete, model_target, require_live_sampler, task_target

router = APIRouter(tags=["completions"], responses=error_responses(401, 403, 404, 409, 422, 429, 503))

_ANSWERS: dict[int | str, dict[str, Any]] = {200: {
    "description": "OpenAI's `chat.completion` (messages) or `text_completion` (prompt), with a `loraplane` object "
                   "(trial, queued_s, load_s); with `stream`, server-sent events of their chunks, then `data: [DONE]`",
    "content": {"application/json": {}, "text/event-stream": {}}}}


@router.post("/tasks/{task_id}/completions", responses=_ANSWERS)
async def complete_best_trial(task_id: PathId, body: CompletionRequest, caller: CallerDep,
                              session: SessionDep) -> Response:
    """An answer from the task's best trial so far (or its kept checkpoint at `checkpoint`): 409 until it has one."""
    target = await _resolved(session, lambda: task_target(session, tenant_id=caller.tenant.id, task_id=task_id,
                                                          trial_id=None, checkpoint=body.checkpoint))
    return await complete(target, body, tenant_id=caller.tenant.id, key_id=caller.key_id)


@router.post("/tasks/{task_id}/trials/{trial_id}/completions", responses=_ANSWERS)
async def complete_trial(task_id: PathId, trial_id: PathId, body: CompletionRequest, caller: CallerDep,
                         session: SessionDep) -> Response:
    """An answer from this trial's adapter (its best-validation adapter, once the trial ended), or from its kept
    checkpoint at step `checkpoint`."""
    target = await _resolved(session, lambda: task_target(session, tenant_id=caller.tenant.id, task_id=task_id,
                                                          trial_id=trial_id, checkpoint=body.checkpoint))
    return await complete(target, body, tenant_id=caller.tenant.id, key_id=caller.key_id)


@router.post("/chat/completions", responses=_ANSWERS)
async def chat_completions(body: ChatCompletionRequest, caller: CallerDep, session: SessionDep) -> Response:
    """OpenAI's chat completions: `model` is a task id (its best trial), `<task id>:<trial id>`,
    `<task id>:<trial id>:<step>` (a kept checkpoint), or a registered base model's name (the base alone)."""
    target = await _resolved(session, lambda: model_target(session, tenant_id=caller.tenant.id, model=body.model))
    return await complete(target, body, tenant_id=caller.tenant.id, key_id=caller.key_id)


async def _resolved(session: Session, resolve: Callable[[], Target]) -> Target:
    """The target, checked to have a live sampler; the database connection is given back before the wait."""

    def run() -> Target:
        try:
            target = resolve()
            require_live_sampler(session, target)
            return target
        finally:
            session.close()

    return await run_in_threadpool(run)
