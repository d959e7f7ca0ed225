"""Sampling (issue 35): what a completion request runs under, the request sent to the workers' samplers, and their
answer read back, whole or as server-sent events in OpenAI's chunk shapes.

The API sends a `SampleRequest` on its base model's stream (common/bus.py `sampling_stream`); the sampler of a worker
that loads the model takes it (worker/sampler.py), decodes it batched with the other requests waiting for that model,
and writes the answer on the request's own stream, which this module reads and then discards. Nothing is written to
the database: an answer is the client's alone.

The waits are bounded: with no live worker able to load the model the answer is a 503 at once; a request no sampler
answers within `LORAPLANE_SAMPLING_TIMEOUT_S` (a cold model's load included) is a 503 `sampling_timeout`, and the
sampler drops it unanswered once its deadline passed. Each API process holds at most
`LORAPLANE_SAMPLING_MAX_INFLIGHT` open requests per tenant (more: 429).

A request in flight is cut off when its API key is revoked or its tenant deleted, as an open event stream is: its key
is watched by the process's `TaskWatch` (api/sse.py), read every `api.sse.POLL_S`, and the request answers 401
`api_key_revoked` (a stream already begun ends with an `event: error` block in the same shape). No piece the
sampler writes after that is sent. The sampler is not told: it finishes its batch, and its answer is discarded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.orm import Session

from api.errors import API_ERROR, INVALID_REQUEST, RATE_LIMIT, UNAVAILABLE, ApiError, conflict, not_found
from api.queries import get_task, get_trial
from api.schemas.completions import ChatCompletionRequest, CompletionRequest, SamplingParameters
from api.services.adapters import no_best_trial
from api.services.checkpoints import get_checkpoint
from api.sse import key_revoked, task_watch
from common.bus import get_bus, sampling_reply_stream, sampling_stream
from common.db import session_scope
from common.messages import ModelSourceFields, SampleReply, SampleRequest, parse_sample_reply
from common.registry import model_source_fields
from common.settings import get_settings
from common.tables import BaseModelEntry, Checkpoint, SamplingUsage, Task, Trial, utcnow
from scheduler.planning.types import loads
from scheduler.service.cluster_state import alive_workers, worker_models

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting request reads its answer's stream


class OpenRequests:
    """Each tenant's open sampling requests in this process, by id, with their deadlines. One that is never closed (a
    stream whose client left before it began, so its generator never ran its ``finally``) stops counting at its
    deadline, so the cap cannot lock a tenant out."""

    def __init__(self) -> None:
        self._open: dict[str, dict[str, float]] = {}

    def count(self, tenant_id: str, now: float) -> int:
        mine = {rid: deadline for rid, deadline in self._open.get(tenant_id, {}).items() if deadline > now}
        self._open[tenant_id] = mine
        return len(mine)

    def open(self, tenant_id: str, request_id: str, deadline: float) -> None:
        self._open.setdefault(tenant_id, {})[request_id] = deadline

    def close(self, tenant_id: str, request_id: str) -> None:
        self._open.get(tenant_id, {}).pop(request_id, None)


open_requests = OpenRequests()


@dataclass(frozen=True)
class Target:
    """What a request samples from: a trial's adapter, or one of its kept checkpoints (``trial`` None: the base
    model alone)."""

    name: str  # what the answer's `model` says
    base: BaseModelEntry
    task: Task | None = None
    trial: Trial | None = None
    checkpoint: Checkpoint | None = None

    @property
    def adapter_key(self) -> str | None:
        if self.checkpoint is not None:
            return self.checkpoint.adapter_key
        return self.trial.adapter_key if self.trial else None


def task_target(session: Session, *, tenant_id: str, task_id: str, trial_id: str | None,
                checkpoint: int | None = None) -> Target:
    """The trial (by default the task's best so far) of one of the tenant's tasks, or its kept checkpoint at step
    ``checkpoint`` (the trial may still train); 404 for another tenant's or an unknown checkpoint, 409 while the trial
    has no adapter."""
    task = get_task(session, tenant_id=tenant_id, task_id=task_id)
    if trial_id is None:
        if task.best_trial_id is None:
            raise no_best_trial(task)
        trial_id = task.best_trial_id
    trial = get_trial(session, tenant_id=tenant_id, task_id=task.id, trial_id=trial_id)
    kept = get_checkpoint(session, trial, checkpoint) if checkpoint is not None else None
    if kept is None and not trial.adapter_key:
        raise conflict("adapter_not_ready", f"Trial '{trial.id}' has no adapter yet (state: {trial.state}), so "
                                            "nothing to sample from; its kept checkpoints can be sampled with "
                                            "`checkpoint`.")
    base = session.get(BaseModelEntry, task.base_model)
    if base is None:
        raise conflict("model_unavailable", f"Task '{task.id}''s base model '{task.base_model}' is no longer "
                                            "registered.")
    name = f"{task.id}:{trial.id}" if kept is None else f"{task.id}:{trial.id}:{kept.step}"
    return Target(name, base, task, trial, kept)


def model_target(session: Session, *, tenant_id: str, model: str) -> Target:
    """`model` of a chat completion: ``<task id>`` (its best trial), ``<task id>:<trial id>``,
    ``<task id>:<trial id>:<step>`` (one of its kept checkpoints), or a registered base model's name (the base
    alone)."""
    task_id, _, rest = model.partition(":")
    trial_id, _, step = rest.partition(":")
    base = session.get(BaseModelEntry, model) if not rest else None
    if base is not None and base.deleted_at is None:
        return Target(base.name, base)
    if step and not (step.isdigit() and len(step) <= 9):
        raise not_found("model", model)
    try:
        return task_target(session, tenant_id=tenant_id, task_id=task_id, trial_id=trial_id or None,
                           checkpoint=int(step) if step else None)
    except ApiError as exc:
        if exc.status_code == 404:
            raise not_found("model", model) from None
        raise


def require_live_sampler(session: Session, target: Target) -> None:
    """503 at once when no live worker with a sampler can load the target's base model."""
    settings = get_settings()
    if not settings.worker_sampler:
        raise _unavailable("sampling_disabled", "Sampling is turned off on this deployment (LORAPLANE_WORKER_SAMPLER).")
    workers = alive_workers(session, utcnow(), settings.worker_timeout_s)
    if not any(loads(worker_models(w), target.base.name) for w in workers):
        raise _unavailable("no_worker", f"No live worker can load base model '{target.base.name}' to sample from it; "
                                        "try again once one is up.")


async def complete(target: Target, body: CompletionRequest | ChatCompletionRequest, *, tenant_id: str,
                   key_id: str) -> Response:
    """Sends the request to the samplers and answers with what they write: JSON, or server-sent events. `key_id`:
    the API key the request was sent with, watched until the answer ends."""
    settings = get_settings()
    if open_requests.count(tenant_id, time.time()) >= settings.sampling_max_inflight:
        raise ApiError(429, RATE_LIMIT, "too_many_requests", f"At most {settings.sampling_max_inflight} sampling "
                       "requests of a tenant at once; wait for one to end.", headers={"Retry-After": "1"})
    request = _sample_request(target, body, tenant_id=tenant_id)
    open_requests.open(tenant_id, request.request_id, request.deadline)
    try:
        await run_in_threadpool(get_bus().publish, sampling_stream(target.base.name), request.to_dict())
        replies = _replies(request, key_id)
        first = await anext(replies)  # a refusal is an HTTP error, not a stream that starts and fails
        _raise_refusal(first)
    except BaseException:
        open_requests.close(tenant_id, request.request_id)
        raise
    chat = isinstance(body, ChatCompletionRequest) or body.messages is not None
    if body.stream:
        return StreamingResponse(_events(first, replies, target, request, chat=chat, tenant_id=tenant_id),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        text, last = first.text, first
        async for reply in replies:  # nothing more after a `done` first: the stream is discarded
            _raise_refusal(reply)
            text, last = text + reply.text, reply
    finally:
        open_requests.close(tenant_id, request.request_id)
    await run_in_threadpool(_record_usage, tenant_id, target, last)
    return JSONResponse(_whole(text, last, target, request, chat=chat))


def _sample_request(target: Target, body: SamplingParameters, *, tenant_id: str) -> SampleRequest:
    now = time.time()
    messages = getattr(body, "messages", None)
    return SampleRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}", tenant_id=tenant_id,
        task_id=target.task.id if target.task else None, trial_id=target.trial.id if target.trial else None,
        adapter_key=target.adapter_key,
        base_model=ModelSourceFields.model_validate(model_source_fields(target.base)),
        messages=[m.model_dump() for m in messages] if messages is not None else None,
        prompt=getattr(body, "prompt", None), max_tokens=body.max_tokens, temperature=body.temperature,
        top_p=body.top_p, seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
        stop=body.stops, stream=body.stream, sent_at=now, deadline=now + get_settings().sampling_timeout_s)


async def _replies(request: SampleRequest, key_id: str) -> AsyncIterator[SampleReply]:
    """The answer's pieces as the sampler writes them, to the one that is ``done``; its stream discarded after. Raises
    401 `api_key_revoked` once the watch read ``key_id`` revoked (or its tenant deleted), before any piece read after.
    """
    bus, stream, after = get_bus(), sampling_reply_stream(request.request_id), "0"
    watch = task_watch()
    try:
        with watch.watching_key(key_id):
            while True:
                messages = await run_in_threadpool(bus.read_after, stream, after, 256, 0)
                if not watch.key_valid(key_id):
                    raise key_revoked("request was sent with")
                for message_id, body in messages:
                    after = message_id
                    reply = parse_sample_reply(body, on_drop=lambda reason: None)
                    if reply is not None:
                        yield reply
                        if reply.done:
                            return
                if time.time() > request.deadline:
                    raise _unavailable("sampling_timeout", f"No worker answered within "
                                       f"{get_settings().sampling_timeout_s:.0f} s (its base model may still be "
                                       "loading, or every sampler is busy); try again.")
                if not messages:
                    await asyncio.sleep(POLL_S)
    finally:
        await run_in_threadpool(bus.discard, stream)


def _raise_refusal(reply: SampleReply) -> None:
    if reply.error_code is None:
        return
    kind = INVALID_REQUEST if reply.status < 500 else (UNAVAILABLE if reply.status == 503 else API_ERROR)
    headers = {"Retry-After": "5"} if reply.status == 503 else None
    raise ApiError(reply.status, kind, reply.error_code, reply.error_message or reply.error_code, headers=headers)


async def _events(first: SampleReply, replies: AsyncIterator[SampleReply], target: Target, request: SampleRequest,
                  *, chat: bool, tenant_id: str) -> AsyncIterator[bytes]:
    """OpenAI's stream: a chunk per piece of text, the last with its finish reason and usage, then ``[DONE]``; a
    failure after the start (the sampler's, a timeout, the key revoked) ends it with an ``event: error`` block whose
    data is the API's error shape, as an event stream ends (api/sse.py); OpenAI's clients raise it too."""
    try:
        created, opened = int(time.time()), False
        async for reply in _after(first, replies):
            _raise_refusal(reply)
            if reply.text or not opened or reply.done:
                chunk = _chunk(reply, target, request, created, chat=chat, opening=not opened)
                opened = True
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if reply.done:
                await run_in_threadpool(_record_usage, tenant_id, target, reply)
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield f"event: error\ndata: {json.dumps(exc.body())}\n\n".encode()
    finally:
        open_requests.close(tenant_id, request.request_id)


async def _after(first: SampleReply, replies: AsyncIterator[SampleReply]) -> AsyncIterator[SampleReply]:
    """``first``, then the rest of ``replies`` (none after a ``done`` first; read all the same, so that the answer's
    stream is discarded)."""
    yield first
    async for reply in replies:
        yield reply


def _chunk(reply: SampleReply, target: Target, request: SampleRequest, created: int, *, chat: bool,
           opening: bool) -> dict[str, Any]:
    finish = reply.finish_reason if reply.done else None
    if chat:
        delta: dict[str, str] = {"role": "assistant"} if opening else {}
        if reply.text:
            delta["content"] = reply.text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": reply.text, "finish_reason": finish}
    chunk: dict[str, Any] = {"id": request.request_id, "object": "chat.completion.chunk" if chat else
                             "text_completion", "created": created, "model": target.name, "choices": [choice]}
    if reply.done:
        chunk["usage"] = _usage(reply)
        chunk["loraplane"] = _extension(reply, target)
    return chunk


def _whole(text: str, last: SampleReply, target: Target, request: SampleRequest, *, chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": request.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": target.name, "choices": [choice], "usage": _usage(last),
            "loraplane": _extension(last, target)}


def _record_usage(tenant_id: str, target: Target, reply: SampleReply) -> None:
    """The answered request's tokens in its tenant's usage (common/usage.py). A write that fails is logged: the
    answer has gone out either way."""
    try:
        with session_scope() as session:
            session.add(SamplingUsage(tenant_id=tenant_id, model=target.name, prompt_tokens=reply.prompt_tokens,
                                      completion_tokens=reply.completion_tokens))
    except Exception:  # noqa: BLE001 - usage is bookkeeping: never the request's failure
        log.exception("could not record the usage of sampling request %s", reply.request_id)


def _usage(reply: SampleReply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def _extension(reply: SampleReply, target: Target) -> dict[str, Any]:
    """What OpenAI's answer lacks: which trial answered, and the wait (queued behind other batches; loading the
    base model and adapters, 0 when warm)."""
    return {"task_id": target.task.id if target.task else None, "trial_id": target.trial.id if target.trial else None,
            "checkpoint_step": target.checkpoint.step if target.checkpoint else None, "base_model": target.base.name,
            "queued_s": reply.queued_s, "load_s": reply.load_s,
            "batch_requests": reply.batch_requests}


def _unavailable(code: str, message: str) -> ApiError:
    return ApiError(503, UNAVAILABLE, code, message, headers={"Retry-After": "5"})
