"""`loraplane api` as a real server process: with `--workers 2` both processes take connections and serve
them, and one that dies is replaced; open SSE streams take no thread and no database connection from status
reads. No speed is asserted (the timeouts are generous); benchmarks/api_load.py measures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.e2e.procs import Proc, child_pids, cluster, cmdline, free_port, wait_ready
from tests.factories import TenantKey, make_task, make_tenant


@contextmanager
def api(tmp_path: Path, workers: int) -> Iterator[tuple[str, Proc]]:
    port = free_port()
    with cluster(dict(os.environ), tmp_path) as c:
        proc = c.start("api", "api", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers))
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, [proc])
        yield base, proc


def _tenant_and_task(base: str) -> tuple[TenantKey, str]:
    with httpx.Client(base_url=base, timeout=30) as http:
        tenant = make_tenant(http)  # type: ignore[arg-type]
        return tenant, make_task(http, tenant)["id"]  # type: ignore[arg-type]


def _status(base: str, tenant: TenantKey, task_id: str) -> dict:
    # A fresh connection each time, to whichever server process the kernel gives it.
    r = httpx.get(f"{base}/v1/tasks/{task_id}", headers=tenant.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _server_workers(api_pid: int) -> list[int]:
    """The server processes of `loraplane api --workers N` (multiprocessing children), not its resource tracker."""
    return [pid for pid in child_pids(api_pid) if any("spawn_main" in arg for arg in cmdline(pid))]


def _connections_held(pid: int, port: int) -> int:
    """Established connections to `port` among process `pid`'s open sockets (from /proc: no psutil)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            held += local_port == port and state == "01" and inode in inodes
    return held


def test_two_workers_share_the_streams_and_one_that_dies_is_replaced(clean_db: None, tmp_path: Path) -> None:
    with api(tmp_path, workers=2) as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        workers = _server_workers(proc.proc.pid)
        assert len(workers) == 2, cmdline(proc.proc.pid)
        tenant, task_id = _tenant_and_task(base)

        streams = 20
        started = threading.Barrier(streams + 1)
        events: list[list[str]] = [[] for _ in range(streams)]

        def follow(seen: list[str]) -> None:
            url = f"{base}/v1/tasks/{task_id}/events/stream"
            with httpx.stream("GET", url, headers=tenant.headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        seen.append(line.removeprefix("event: "))
                        if len(seen) == 1:
                            started.wait(timeout=60)

        followers = [threading.Thread(target=follow, args=(seen,)) for seen in events]
        for follower in followers:
            follower.start()
        started.wait(timeout=60)
        # Each process has its own listening socket and the kernel spreads connections over them: with 20, both
        # hold some (all 20 on one would happen once in half a million runs), and each serves its streams.
        held = {pid: _connections_held(pid, port) for pid in workers}
        assert sum(held.values()) == streams and all(held.values()), held
        assert [_status(base, tenant, task_id)["state"] for _ in range(5)] == ["queued"] * 5

        r = httpx.post(f"{base}/v1/tasks/{task_id}/cancel", headers=tenant.headers, timeout=30)
        assert r.status_code == 200, r.text
        for follower in followers:
            follower.join(timeout=60)
        assert events == [["task.created", "task.small_validation", "task.cancelled", "end"]] * streams

        # A server process that dies is replaced; the port keeps answering meanwhile.
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(replaced := _server_workers(proc.proc.pid)) != 2 or workers[0] in replaced:
            assert time.monotonic() < deadline, replaced
            time.sleep(0.2)
        assert [_status(base, tenant, task_id)["state"] for _ in range(5)] == ["cancelled"] * 5


def test_a_hundred_open_streams_leave_status_reads_answering(clean_db: None, tmp_path: Path) -> None:
    streams = 100
    with api(tmp_path, workers=1) as (base, _proc):
        tenant, task_id = _tenant_and_task(base)

        async def main() -> None:
            started = 0
            all_started = asyncio.Event()
            ends: list[str] = []

            async def follow(client: httpx.AsyncClient) -> None:
                nonlocal started
                async with client.stream("GET", f"/v1/tasks/{task_id}/events/stream", headers=tenant.headers) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line == "event: task.created":
                            started += 1
                            if started == streams:
                                all_started.set()
                        elif line == "event: end":
                            ends.append(line)

            limits = httpx.Limits(max_connections=streams + 1)  # one more for the cancel
            async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(60, read=None)) as client:
                # All at once: before api/deps.py returned the key lookup's connection, a burst like this one
                # left every worker thread waiting for a connection held by a request waiting for a thread.
                followers = [asyncio.create_task(follow(client)) for _ in range(streams)]
                await asyncio.wait_for(all_started.wait(), timeout=120)
                for _ in range(10):
                    body = await asyncio.to_thread(_status, base, tenant, task_id)
                    assert body["state"] == "queued"
                assert not any(f.done() for f in followers)  # every stream is still open

                r = await client.post(f"/v1/tasks/{task_id}/cancel", headers=tenant.headers)
                assert r.status_code == 200, r.text
                # One watch read sees the final state for all of them; each stream then sends its `end`.
                await asyncio.wait_for(asyncio.gather(*followers), timeout=120)
            assert len(ends) == streams

        asyncio.run(main())
