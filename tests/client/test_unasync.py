"""`loraplane/client/_sync.py` is generated from `_async.py` by `_unasync.py`: the two clients cannot drift."""

from __future__ import annotations

import inspect
import io
import tokenize

from loraplane.client import _async, _sync, _unasync

RESOURCES = [("AsyncClient", "Client"), ("AsyncFiles", "Files"), ("AsyncModels", "Models"), ("AsyncTasks", "Tasks"),
             ("AsyncWebhooks", "Webhooks"), ("AsyncAdmin", "Admin")]


def test_the_committed_sync_client_is_what_the_async_one_generates() -> None:
    generated = _unasync.generate(_unasync.SOURCE.read_text(encoding="utf-8"))
    assert _unasync.TARGET.read_text(encoding="utf-8") == generated, (
        "loraplane/client/_sync.py is not what _async.py gives: it is generated, so change _async.py and run "
        "`python -m loraplane.client._unasync`")
    assert _unasync.main(["--check"]) == 0


def test_nothing_async_is_left_in_the_sync_client() -> None:
    source = _unasync.TARGET.read_text(encoding="utf-8")
    names = {t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NAME}
    assert not names & {"async", "await", "anyio", "asyncio", "asynccontextmanager", "aclose", "aread"}
    assert not {n for n in names if n.startswith("Async") or n.startswith("aiter_")}
    assert source.startswith("# Generated from _async.py by loraplane/client/_unasync.py: do not edit.")


def test_both_clients_have_the_same_methods_with_the_same_parameters() -> None:
    for async_name, sync_name in RESOURCES:
        async_cls, sync_cls = getattr(_async, async_name), getattr(_sync, sync_name)
        methods = {n for n in vars(async_cls) if not n.startswith("_") or n == "__init__"}
        assert methods == {n for n in vars(sync_cls) if not n.startswith("_") or n == "__init__"}
        for name in methods:
            a, s = inspect.signature(getattr(async_cls, name)), inspect.signature(getattr(sync_cls, name))
            assert [(p.name, p.kind, p.default) for p in a.parameters.values()] == [
                (p.name, p.kind, p.default) for p in s.parameters.values()], f"{sync_name}.{name}"
            if name != "__init__":
                async_fn, sync_fn = getattr(async_cls, name), getattr(sync_cls, name)
                assert inspect.iscoroutinefunction(async_fn) or inspect.isasyncgenfunction(async_fn)
                assert not (inspect.iscoroutinefunction(sync_fn) or inspect.isasyncgenfunction(sync_fn))
    assert _sync.Client.__doc__ and _sync.Client.__doc__.startswith("The loraplane API from Python.")
    assert "coroutine" not in (_sync.Tasks.wait.__doc__ or "") and "coroutine" in (_async.AsyncTasks.wait.__doc__ or "")


def test_the_generator_rewrites_aligns_and_swaps_the_marked_blocks() -> None:
    source = '''\
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager


class AsyncThing:
    # unasync: async-only
    """Awaited."""
    # unasync: sync-only
    # """Called.
    #
    #     Thing().go()
    # """
    # unasync: end

    async def go(self, a: int,
                 b: int) -> AsyncIterator[int]:
        x = await self.call(a, {"b": b,
                                "c": 1})
        y = (await self.get(a)).state
        async with self._http.stream("GET", "/",
                                     timeout=1) as response:
            async for line in response.aiter_lines():
                yield line
        for item in y:
            yield item
        for item in y:
            yield item
            x += 1
'''
    assert _unasync.generate(source) == _unasync.HEADER + '''\
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Thing:
    """Called.

        Thing().go()
    """

    def go(self, a: int,
           b: int) -> Iterator[int]:
        x = self.call(a, {"b": b,
                          "c": 1})
        y = self.get(a).state
        with self._http.stream("GET", "/",
                               timeout=1) as response:
            yield from response.iter_lines()
        yield from y
        for item in y:
            yield item
            x += 1
'''
