"""`loraplane.client.AsyncClient`: the same journey as the sync client's tests, awaited, on asyncio."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplane.client import APIConnectionError, APIError, AsyncClient, ConfigurationError, Event, WaitTimeout
from tests.client import sim
from tests.conftest import ADMIN_TOKEN
from tests.e2e.procs import free_port
from tests.factories import TenantKey, chat_rows, task_body


def run(api_url: str, key: str | None, body: Callable[[AsyncClient], Awaitable[Any]], **kwargs: Any) -> Any:
    async def main() -> Any:
        async with AsyncClient(api_url, key, admin_token=ADMIN_TOKEN, **kwargs) as lp:
            return await body(lp)

    return asyncio.run(main())


def test_files_models_and_tasks(api_url: str, tenant: TenantKey, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(chat_rows(8))

    async def body(lp: AsyncClient) -> None:
        f = await lp.files.upload(path)
        small = await lp.files.upload(chat_rows(2), filename="small.jsonl")
        assert (f.filename, f.rows, small.rows) == ("train.jsonl", 8, 2)
        assert [x.id for x in await lp.files.list()] == [small.id, f.id]
        assert (await lp.files.list(limit=1)).has_more
        assert await lp.files.get(f.id) == f
        assert (await lp.files.delete(small.id)).deleted
        with pytest.raises(APIError) as err:
            await lp.files.upload(b"nope\n", filename="bad.jsonl")
        assert (err.value.status_code, err.value.code, err.value.param) == (422, "invalid_file", "file")

        assert "tiny-random-llama" in {m.id for m in await lp.models.list()}
        assert (await lp.models.get("tiny-random-llama")).kind
        with pytest.raises(APIError) as err:
            await lp.models.get("nope")
        assert err.value.status_code == 404

        task = await lp.tasks.create(task_body(f.id, max_steps=4, epochs=None), idempotency_key="k")
        assert (await lp.tasks.create(task_body(f.id, max_steps=4, epochs=None), idempotency_key="k")).id == task.id
        assert task.state == "queued" and task.trial_counts.total == 4
        assert [t.id for t in await lp.tasks.list(state="queued", limit=5)] == [task.id]
        assert (await lp.tasks.get(task.id)).id == task.id
        with pytest.raises(APIError) as err:
            await lp.tasks.create(task_body(f.id, max_seq_len=1))
        assert (err.value.status_code, err.value.param) == (422, "max_seq_len")
        assert (await lp.tasks.cancel(task.id)).state == "cancelled"
        with pytest.raises(APIError) as err:
            await lp.tasks.cancel(task.id)
        assert (err.value.status_code, err.value.code) == (409, "task_finished")

    run(api_url, tenant.key, body)


def test_follow_a_running_task_then_read_its_results(api_url: str, tenant: TenantKey, tmp_path: Path) -> None:
    async def body(lp: AsyncClient) -> None:
        f = await lp.files.upload(chat_rows())
        task = await lp.tasks.create(task_body(f.id, max_steps=3, epochs=None))
        worker = sim.later(0.3, lambda: sim.start(task.id), lambda: sim.finish(task.id, [3.0, 2.0, 2.5, 2.8]))
        seen: list[Event] = []

        async def on_event(event: Event) -> None:
            seen.append(event)

        done = await lp.tasks.wait(task.id, timeout=30, on_event=on_event)
        worker.join()
        assert done.state == "succeeded" and done.best_trial is not None and done.best_trial.best_val_loss == 2.0
        assert seen[0].type == "task.created" and seen[-1].type == "task.succeeded"
        streamed = [e.id async for e in lp.tasks.stream_events(task.id)]
        assert streamed == [e.id for e in seen] == [e.id for e in await lp.tasks.events(task.id)]
        assert [e.id async for e in lp.tasks.iter_events(task.id, after=seen[-2].id)] == [seen[-1].id]

        trials = await lp.tasks.trials(task.id)
        assert len(trials) == 4 and trials[1].best_val_loss == 2.0
        assert await lp.tasks.trial(task.id, trials[1].id) == trials[1]
        metrics = await lp.tasks.metrics(task.id, trials[1].id, step_from=2)
        assert [p.step for p in metrics.train] == [2, 3] and [p.loss for p in metrics.val] == [2.0]
        assert len(await lp.tasks.curves(task.id)) == 4
        best = await lp.tasks.download_adapter(task.id, tmp_path / "best")
        assert json.loads((best / "adapter_config.json").read_text())["r"] == 16
        other = await lp.tasks.download_adapter(task.id, tmp_path / "t0", trial_id=trials[0].id)
        assert json.loads((other / "adapter_config.json").read_text())["r"] == 8
        with pytest.raises(WaitTimeout):
            queued = await lp.tasks.create(task_body(f.id))
            await lp.tasks.wait(queued.id, timeout=0.5, poll_interval=0.1)

    run(api_url, tenant.key, body)


class BrokenStreams(httpx.AsyncHTTPTransport):
    """A proxy that cannot pass an event stream (answers 502)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events/stream"):
            return httpx.Response(502, text="Bad Gateway")
        return await super().handle_async_request(request)


def test_events_are_polled_when_the_stream_cannot_be_used(api_url: str, tenant: TenantKey) -> None:
    async def body(lp: AsyncClient) -> None:
        f = await lp.files.upload(chat_rows())
        task = await lp.tasks.create(task_body(f.id, max_steps=3, epochs=None))
        worker = sim.later(0.3, lambda: sim.start(task.id), lambda: sim.finish(task.id, [3.0, 2.0, 2.5, 2.8]))
        events = [e async for e in lp.tasks.iter_events(task.id, poll_interval=0.1, timeout=30)]
        worker.join()
        assert events[-1].type == "task.succeeded"
        assert [e.id for e in events] == [e.id for e in await lp.tasks.events(task.id)]
        with pytest.raises(APIConnectionError):
            [e async for e in lp.tasks.stream_events(task.id)]

    run(api_url, tenant.key, body, transport=BrokenStreams())


def test_admin_and_failures(api_url: str, tenant: TenantKey, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(lp: AsyncClient) -> None:
        made = await lp.admin.create_tenant("initech", max_file_bytes=10_000)
        assert made.max_file_bytes == 10_000 and await lp.admin.get_tenant(made.id) == made
        assert {t.name for t in await lp.admin.list_tenants()} == {"acme", "initech"}
        assert (await lp.admin.update_tenant(made.id, name="initrode")).name == "initrode"
        key = await lp.admin.create_api_key(made.id, name="ci")
        assert key.key and [k.id for k in await lp.admin.list_api_keys(made.id)] == [key.id]
        assert (await lp.admin.revoke_api_key(key.id)).revoked_at is not None
        assert (await lp.admin.list_workers()).data == []
        with pytest.raises(APIError) as err:
            await lp.admin.create_tenant("acme")
        assert (err.value.status_code, err.value.code) == (409, "tenant_exists")

    run(api_url, tenant.key, body)

    async def unreachable(lp: AsyncClient) -> None:
        with pytest.raises(APIConnectionError):
            await lp.models.list()

    run(f"http://127.0.0.1:{free_port()}", "lp_x", unreachable)
    monkeypatch.delenv("LORAPLANE_API_KEY", raising=False)

    async def keyless(lp: AsyncClient) -> None:
        with pytest.raises(ConfigurationError):
            await lp.tasks.list()

    run(api_url, None, keyless)
