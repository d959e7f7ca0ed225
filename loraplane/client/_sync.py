"""The synchronous client. `_async.py` is the same client, method for method, with `await`."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from loraplane.client import _core
from loraplane.client._core import ADMIN_HINT, KEY_HINT, StreamBroken, StreamEnded
from loraplane.client.config import resolve
from loraplane.client.errors import APIConnectionError, APIError, WaitTimeout
from loraplane.client.models import (
    TASK_FINAL_STATES,
    ApiKey,
    Event,
    File,
    FileDeleted,
    Model,
    Page,
    RegisteredModel,
    Task,
    Tenant,
    Trial,
    TrialMetrics,
    Usage,
    Webhook,
    WebhookDeleted,
    WebhookDelivery,
    Worker,
    page,
)


class Client:
    """The loraplane API from Python.

        with Client() as lp:                            # URL and key: arguments, env, or `loraplane login`
            f = lp.files.upload("train.jsonl")
            task = lp.tasks.create({"base_model": "tiny-random-llama", "training_file": f.id,
                                    "search_space": {"learning_rate": [1e-3, 3e-3]}, "max_steps": 30})
            task = lp.tasks.wait(task.id, on_event=lambda e: print(e.type, e.message))
            lp.tasks.download_adapter(task.id, "adapter/")

    Args:
        base_url: the API's root (`http://host:8000`); default `LORAPLANE_API_URL`, the config file, then
            `http://127.0.0.1:8000`.
        api_key: a tenant key (`lp_...`) for everything but `admin`; default `LORAPLANE_API_KEY`, the config file.
        admin_token: the operator's token for `admin`; default `LORAPLANE_ADMIN_TOKEN`.
        timeout: seconds for each request (event streams wait longer between messages).
        transport: an httpx transport (tests, proxies).
        config_file: read instead of the default config file.

    Raises (from every call): `APIError` for an error answer, `APIConnectionError` when the API cannot be
    reached, `ConfigurationError` when the key or token the call needs is missing.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        admin_token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        config_file: Path | None = None,
    ) -> None:
        settings = resolve(base_url, api_key, admin_token, config_file=config_file)
        self.base_url, self.api_key, self.admin_token = settings.base_url, settings.api_key, settings.admin_token
        self.timeout = httpx.Timeout(timeout)
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=transport,
                                  headers={"User-Agent": _core.USER_AGENT})
        self.files = Files(self)
        self.models = Models(self)
        self.tasks = Tasks(self)
        self.webhooks = Webhooks(self)
        self.admin = Admin(self)

    def usage(self, *, start: datetime | str | None = None, end: datetime | str | None = None) -> Usage:
        """This tenant's usage in [start, end) (default: since the beginning, until now)."""
        params = _core.params(**{"from": _core.iso(start), "to": _core.iso(end)})
        return Usage.of(self._json("GET", "/v1/usage", params=params))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _auth(self, admin: bool) -> dict[str, str]:
        if admin:
            return _core.bearer(self.admin_token, "admin token", ADMIN_HINT)
        return _core.bearer(self.api_key, "API key", KEY_HINT)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Network failures, while sending or while reading a streamed body, as APIConnectionError."""
        try:
            yield
        except httpx.TransportError as exc:
            raise _core.connection_error(exc, self.base_url) from exc

    def request(self, method: str, path: str, *, admin: bool = False, headers: Mapping[str, str] | None = None,
                **kwargs: Any) -> httpx.Response:
        """One call; raises APIError for a 4xx/5xx answer. The building block of every method."""
        with self._guard():
            response = self._http.request(method, path, headers={**self._auth(admin), **(headers or {})}, **kwargs)
        if response.status_code >= 400:
            raise APIError.from_response(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return _core.json_body(self.request(method, path, **kwargs))

    @contextmanager
    def _stream(self, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        with self._guard(), self._http.stream("GET", path, headers=self._auth(False), **kwargs) as response:
            if response.status_code >= 400:
                response.read()
                raise APIError.from_response(response)
            yield response


class Files:
    """Datasets: one JSONL file of `{"messages": [...]}` or `{"prompt", "completion"}` rows."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def upload(self, file: _core.FileInput, *, filename: str | None = None, purpose: str = "fine-tune") -> File:
        """`file`: a local path (str or Path), the bytes, or an open binary file. Every row is checked."""
        part = _core.upload_part(file, filename)
        return File.of(self._c._json("POST", "/v1/files", files={"file": part}, data={"purpose": purpose}))

    def list(self, *, limit: int | None = None, after: str | None = None) -> Page[File]:
        """Newest first; `after`: the last id of the previous page."""
        return page(self._c._json("GET", "/v1/files", params=_core.params(limit=limit, after=after)), File)

    def get(self, file_id: str) -> File:
        return File.of(self._c._json("GET", f"/v1/files/{file_id}"))

    def delete(self, file_id: str) -> FileDeleted:
        """Refused (409) while a task that has not finished uses the file."""
        return FileDeleted.of(self._c._json("DELETE", f"/v1/files/{file_id}"))


class Models:
    """The base models tasks can tune."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def list(self) -> Page[Model]:
        return page(self._c._json("GET", "/v1/models"), Model)

    def get(self, name: str) -> Model:
        return Model.of(self._c._json("GET", f"/v1/models/{name}"))


class Webhooks:
    """Endpoints the service POSTs this tenant's task outcomes to (signed; README "Webhooks")."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def create(self, url: str, *, events: list[str] | None = None, description: str | None = None) -> Webhook:
        """The answer's `.secret` signs every delivery; it is shown only here."""
        body = _core.params(url=url, events=events, description=description)
        return Webhook.of(self._c._json("POST", "/v1/webhooks", json=body))

    def list(self) -> Page[Webhook]:
        return page(self._c._json("GET", "/v1/webhooks"), Webhook)

    def delete(self, webhook_id: str) -> WebhookDeleted:
        return WebhookDeleted.of(self._c._json("DELETE", f"/v1/webhooks/{webhook_id}"))

    def deliveries(self, webhook_id: str, *, limit: int | None = None, after: str | None = None
                   ) -> Page[WebhookDelivery]:
        """Newest first; `after`: the last id of the previous page."""
        params = _core.params(limit=limit, after=after)
        return page(self._c._json("GET", f"/v1/webhooks/{webhook_id}/deliveries", params=params),
                    WebhookDelivery)


class Tasks:
    """Tuning tasks: create, follow, inspect, cancel, and download their adapters."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def create(self, spec: Mapping[str, Any], *, idempotency_key: str | None = None) -> Task:
        """`spec` is the API's task body (README, API tour). The same `idempotency_key` returns the first task."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return Task.of(self._c._json("POST", "/v1/tasks", json=dict(spec), headers=headers))

    def list(self, *, state: str | None = None, limit: int | None = None, after: str | None = None) -> Page[Task]:
        """Newest first, optionally only tasks in `state`; `after`: the last id of the previous page."""
        return page(self._c._json("GET", "/v1/tasks", params=_core.params(state=state, limit=limit, after=after)), Task)

    def get(self, task_id: str) -> Task:
        return Task.of(self._c._json("GET", f"/v1/tasks/{task_id}"))

    def cancel(self, task_id: str) -> Task:
        """Cancels the task and its unfinished trials; 409 `task_finished` when it already finished."""
        return Task.of(self._c._json("POST", f"/v1/tasks/{task_id}/cancel"))

    def trials(self, task_id: str) -> Page[Trial]:
        """All trials, by index."""
        return page(self._c._json("GET", f"/v1/tasks/{task_id}/trials"), Trial)

    def trial(self, task_id: str, trial_id: str) -> Trial:
        return Trial.of(self._c._json("GET", f"/v1/tasks/{task_id}/trials/{trial_id}"))

    def metrics(self, task_id: str, trial_id: str, *, step_from: int | None = None,
                step_to: int | None = None) -> TrialMetrics:
        """The trial's train and validation loss by step (and `metric`: its scores on the task's generative metric),
        optionally within [step_from, step_to]."""
        params = _core.params(step_from=step_from, step_to=step_to)
        return TrialMetrics.of(self._c._json("GET", f"/v1/tasks/{task_id}/trials/{trial_id}/metrics", params=params))

    def curves(self, task_id: str) -> _core.JsonLines:
        """Every trial's curves, one object per trial: the JSONL `loraplane replay` reads."""
        response = self._c.request("GET", f"/v1/tasks/{task_id}/curves")
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]

    def events(self, task_id: str, *, after: int | None = None, limit: int | None = None) -> Page[Event]:
        """One page of events in order; pass `next_after` back as `after`."""
        return page(self._c._json("GET", f"/v1/tasks/{task_id}/events", params=_core.params(after=after, limit=limit)),
                    Event)

    def stream_events(self, task_id: str, *, after: int | None = None,
                      timeout: float | None = None) -> Iterator[Event]:
        """The live Server-Sent Events stream, events after `after`, until the task is final (no fallback:
        a stream that breaks raises APIConnectionError; `iter_events` falls back to polling instead).
        Raises WaitTimeout after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            yield from self._sse(task_id, after or 0, deadline)
        except StreamBroken as exc:
            raise APIConnectionError(f"the event stream of {task_id} broke: {exc}", url=self._c.base_url) from exc

    def iter_events(self, task_id: str, *, after: int | None = None, timeout: float | None = None,
                    poll_interval: float = 1.0) -> Iterator[Event]:
        """Every event after `after` (all of them by default) until the task is final: from the SSE stream,
        or, when it cannot be used (a proxy that buffers or cuts it), by polling every `poll_interval` s from
        the last event seen. Raises WaitTimeout after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last = after or 0
        try:
            for event in self._sse(task_id, last, deadline):
                last = event.id
                yield event
            return
        except StreamBroken:
            pass
        yield from self._poll(task_id, last, deadline, poll_interval)

    def wait(self, task_id: str, *, timeout: float | None = None, poll_interval: float = 1.0,
             on_event: Callable[[Event], object] | None = None) -> Task:
        """Follows the task (`iter_events`) until it is final and returns it; `on_event` sees every event."""
        for event in self.iter_events(task_id, timeout=timeout, poll_interval=poll_interval):
            if on_event is not None:
                on_event(event)
        return self.get(task_id)

    def download_adapter(self, task_id: str, directory: str | os.PathLike[str] | None = None, *,
                         trial_id: str | None = None) -> Path:
        """The best trial's adapter (or `trial_id`'s), unpacked into `directory` (default
        `./<task>-<trial>-adapter`): a PEFT directory. Returns the directory; 409 until there is an adapter."""
        path = f"/v1/tasks/{task_id}/adapter" if trial_id is None else f"/v1/tasks/{task_id}/trials/{trial_id}/adapter"
        with self._c._stream(path) as response, tempfile.TemporaryFile() as archive:
            for chunk in response.iter_bytes():
                archive.write(chunk)
            return _core.extract_archive(archive, _core.archive_dir(response, directory))

    def _sse(self, task_id: str, after: int, deadline: float | None) -> Iterator[Event]:
        left = None if deadline is None else deadline - time.monotonic()
        timeout = _core.stream_timeout(self._c.timeout, left)
        params = {"after": after} if after else None
        try:
            with self._c._stream(f"/v1/tasks/{task_id}/events/stream", params=params, timeout=timeout) as response:
                _core.check_stream(response)
                decoder = _core.SSEDecoder()
                for line in response.iter_lines():
                    if deadline is not None and time.monotonic() > deadline:
                        raise WaitTimeout(f"{task_id} is not finished after the timeout")
                    if (message := decoder.feed(line)) is not None:
                        yield _core.sse_event(*message)
        except StreamEnded:
            return
        except APIConnectionError as exc:
            raise StreamBroken(str(exc)) from exc
        except APIError as exc:
            if not exc.is_server_error:
                raise
            raise StreamBroken(str(exc)) from exc
        raise StreamBroken("the stream closed before the task finished")

    def _poll(self, task_id: str, after: int, deadline: float | None, interval: float) -> Iterator[Event]:
        while True:
            state = self.get(task_id).state  # first: a final state read here means every event is written
            while True:
                events = self.events(task_id, after=after, limit=_core.EVENTS_PAGE)
                yield from events
                after = events.next_after if events.next_after is not None else after
                if not events.has_more:
                    break
            if state in TASK_FINAL_STATES:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise WaitTimeout(f"{task_id} is not finished after the timeout")
            time.sleep(interval if deadline is None else min(interval, deadline - now))


class Admin:
    """Operator calls (the admin token): tenants, their API keys, the worker fleet."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def create_tenant(self, name: str, *, weight: float | None = None, max_concurrent_trials: int | None = None,
                      max_trials_per_task: int | None = None, max_file_bytes: int | None = None,
                      max_storage_bytes: int | None = None, max_files: int | None = None) -> Tenant:
        """Left-out quotas take the deployment's defaults; 409 `tenant_exists` for a name in use."""
        body = _core.params(name=name, weight=weight, max_concurrent_trials=max_concurrent_trials,
                       max_trials_per_task=max_trials_per_task, max_file_bytes=max_file_bytes,
                       max_storage_bytes=max_storage_bytes, max_files=max_files)
        return Tenant.of(self._c._json("POST", "/v1/admin/tenants", json=body, admin=True))

    def list_tenants(self, *, limit: int | None = None, after: str | None = None) -> Page[Tenant]:
        params = _core.params(limit=limit, after=after)
        return page(self._c._json("GET", "/v1/admin/tenants", params=params, admin=True), Tenant)

    def get_tenant(self, tenant_id: str) -> Tenant:
        return Tenant.of(self._c._json("GET", f"/v1/admin/tenants/{tenant_id}", admin=True))

    def update_tenant(self, tenant_id: str, **changes: Any) -> Tenant:
        """Any of name, weight, max_concurrent_trials, max_trials_per_task, max_file_bytes, max_storage_bytes,
        max_files."""
        return Tenant.of(self._c._json("PATCH", f"/v1/admin/tenants/{tenant_id}", json=changes, admin=True))

    def create_api_key(self, tenant_id: str, *, name: str = "") -> ApiKey:
        """The new key's secret is in `.key`, in this answer only."""
        path = f"/v1/admin/tenants/{tenant_id}/api-keys"
        return ApiKey.of(self._c._json("POST", path, json={"name": name}, admin=True))

    def list_api_keys(self, tenant_id: str) -> Page[ApiKey]:
        return page(self._c._json("GET", f"/v1/admin/tenants/{tenant_id}/api-keys", admin=True), ApiKey)

    def revoke_api_key(self, key_id: str) -> ApiKey:
        """At once, and idempotent."""
        return ApiKey.of(self._c._json("DELETE", f"/v1/admin/api-keys/{key_id}", admin=True))

    def list_workers(self) -> Page[Worker]:
        return page(self._c._json("GET", "/v1/admin/workers", admin=True), Worker)

    def usage(self, *, start: datetime | str | None = None, end: datetime | str | None = None) -> Page[Usage]:
        """Every tenant's usage in [start, end) (default: since the beginning, until now)."""
        params = _core.params(**{"from": _core.iso(start), "to": _core.iso(end)})
        return page(self._c._json("GET", "/v1/admin/usage", params=params, admin=True), Usage)

    def register_model(self, name: str, path: str, *, description: str | None = None, kind: str | None = None,
                      file: str | None = None, tenants: list[str] | None = None) -> RegisteredModel:
        """`path`: a model directory as the workers see it (kind "hf", the default) or the folder of a GGUF `file`
        (kind "gguf"). `tenants`: the ids that may use it (default every tenant). 409 `model_exists`; 422 naming
        what is wrong with the directory."""
        body = _core.params(name=name, path=path, description=description, kind=kind, file=file, tenants=tenants)
        return RegisteredModel.of(self._c._json("POST", "/v1/admin/models", json=body, admin=True))

    def list_models(self, *, include_deleted: bool = False) -> Page[RegisteredModel]:
        """Every registered model; retired ones (`deleted_at` set) too with `include_deleted`."""
        params = {"include_deleted": "true"} if include_deleted else None
        return page(self._c._json("GET", "/v1/admin/models", params=params, admin=True), RegisteredModel)

    def get_model(self, name: str) -> RegisteredModel:
        return RegisteredModel.of(self._c._json("GET", f"/v1/admin/models/{name}", admin=True))

    def update_model(self, name: str, **changes: Any) -> RegisteredModel:
        """`description`, `tenants` (None: every tenant); the model's files are read again (chat_template...)."""
        return RegisteredModel.of(self._c._json("PATCH", f"/v1/admin/models/{name}", json=changes, admin=True))

    def delete_model(self, name: str) -> None:
        """Retire the model: hidden, unknown to new tasks, its name free to register again (finished tasks keep
        naming it). Refused (409 `model_in_use`) while a validating, queued or running task uses it."""
        self._c.request("DELETE", f"/v1/admin/models/{name}", admin=True)
