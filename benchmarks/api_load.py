"""Status polling under load: `GET /v1/tasks/{id}` at 32 connections while 100 SSE streams of the same task
stay open, against `loraplane api --workers N` started here, embedded (SQLite under a private
LORAPLANE_HOME) and distributed (a fresh PostgreSQL database, dropped after; a private Redis namespace).

Loopback only (127.0.0.1); every measurement runs for a fixed time. The load comes from wrk where it is
installed (`apt-get install wrk`), else from an httpx/asyncio generator (slower: it needs more of the CPU
it shares with the server); the output says which. The load generator, the stream holders and the server
share this machine's cores, so the numbers are what the API gets from what is left.

    .venv/bin/python -m benchmarks.api_load                        # both modes, 1 and auto workers
    .venv/bin/python -m benchmarks.api_load --modes embedded --workers 1,2 --streams 0,100 --duration 10

The server runs with whatever uvicorn finds installed (h11 and asyncio with loraplane's dependencies; httptools
and uvloop with `uvicorn[standard]`, e.g. `pip install --target DIR httptools uvloop` and `PYTHONPATH=DIR`, with
`--tag standard`); the result says which.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common import write_result

HOST = "127.0.0.1"
SERVER_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
TARGET_RPS = 1000.0
TARGET_P99_MS = 100.0
TARGET_STREAMS = 100
WARMUP_S = 2.0
WRK_SCRIPT = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT {\\"requests\\": %d, \\"duration_us\\": %d, \\"p50_us\\": %d, \\"p99_us\\": %d, \\"max_us\\": %d, "
    .. "\\"connect\\": %d, \\"read\\": %d, \\"write\\": %d, \\"status\\": %d, \\"timeout\\": %d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@dataclass
class Load:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


# (url, API key, connections, seconds) -> what the load generator measured
LoadFn = Callable[[str, str, int, float], Load]


@dataclass
class Seeded:
    key: str
    task_id: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _worker_count(text: str) -> int:
    return _cores() if text == "auto" else int(text)


# ---- the server ---------------------------------------------------------------------------------------


@dataclass
class ApiServer:
    base: str
    pgid: int  # its process group: `loraplane api` and its server processes

    def cpu_s(self) -> float:
        """CPU seconds the server's processes have used so far (Linux /proc)."""
        ticks = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:  # the process ended meanwhile
                continue
            fields = text[text.rindex(")") + 2:].split()  # state, ppid, pgrp, ..., utime (11), stime (12)
            if int(fields[2]) == self.pgid:
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def api_server(env: dict[str, str], workers: int, log_path: Path) -> Iterator[ApiServer]:
    """`loraplane api --workers N` on a free loopback port; stopped (its whole process group) on exit."""
    port = _free_port()
    argv = [sys.executable, "-m", "loraplane.cli", "api", "--host", HOST, "--port", str(port),
            "--workers", str(workers)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{HOST}:{port}"
    try:
        # Ready once 20 fresh connections in a row were answered within a second: each lands on a random server
        # process, and one still starting would leave its connection waiting.
        deadline, answered = time.monotonic() + 60, 0
        while answered < 20:
            if proc.poll() is not None:
                raise RuntimeError(f"the API exited with {proc.returncode}; see {log_path}")
            try:
                answered = answered + 1 if httpx.get(f"{base}/healthz", timeout=1).status_code == 200 else 0
            except httpx.TransportError:
                answered = 0
                time.sleep(0.2)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API did not answer within 60 s; see {log_path}")
        yield ApiServer(base=base, pgid=proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def seed(base: str, admin_token: str) -> Seeded:
    """A tenant, its key, a dataset and a queued 8-trial task, through the API (no scheduler runs, so the
    task stays queued and its streams stay open)."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=base, timeout=30) as client:
        r = client.post("/v1/admin/tenants", json={"name": "bench"}, headers=admin)
        r.raise_for_status()
        tenant_id = r.json()["id"]
        r = client.post(f"/v1/admin/tenants/{tenant_id}/api-keys", json={"name": "bench"}, headers=admin)
        r.raise_for_status()
        key = r.json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                for i in range(20)]
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        r = client.post("/v1/files", headers=auth, files={"file": ("train.jsonl", data)})
        r.raise_for_status()
        body = {"base_model": "tiny-random-llama", "training_file": r.json()["id"], "epochs": 1,
                "search_space": {"learning_rate": [1e-4, 3e-4], "lora_rank": [4, 8, 16, 32]}}
        r = client.post("/v1/tasks", headers=auth, json=body)
        r.raise_for_status()
        return Seeded(key=key, task_id=r.json()["id"])


# ---- the open streams ---------------------------------------------------------------------------------


class Streams:
    """`count` SSE streams of one task, held open in a thread of their own; each must deliver the task's
    first event before the measurement starts, and none may end while it runs."""

    def __init__(self, base: str, seeded: Seeded, count: int) -> None:
        self.base, self.seeded, self.count = base, seeded, count
        self.first_event = 0
        self.ended = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _one(self, client: httpx.AsyncClient) -> None:
        url = f"/v1/tasks/{self.seeded.task_id}/events/stream"
        async with client.stream("GET", url, headers={"Authorization": f"Bearer {self.seeded.key}"}) as r:
            r.raise_for_status()
            seen = False
            async for line in r.aiter_lines():
                if line.startswith("event:") and not seen:
                    seen = True
                    self.first_event += 1
                    if self.first_event == self.count:
                        self._ready.set()
        self.ended += 1

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        limits = httpx.Limits(max_connections=self.count, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.base, timeout=httpx.Timeout(30, read=None), limits=limits) as c:
            tasks = [asyncio.create_task(self._one(c)) for _ in range(self.count)]
            await self._stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Streams:
        self._thread.start()
        if self.count and not self._ready.wait(60):  # measured all the same; the row says how many were open
            print(f"only {self.first_event} of {self.count} SSE streams delivered their first event in 60 s",
                  flush=True)
        return self

    def __exit__(self, *_exc: object) -> None:
        stop = self._stop
        if stop is not None:
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=30)


# ---- the load -----------------------------------------------------------------------------------------


def wrk_load(url: str, key: str, connections: int, seconds: float) -> Load:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT)
    try:
        argv = ["wrk", f"-t{min(connections, _cores())}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                "--timeout", "10s", "-H", f"Authorization: Bearer {key}", "-s", script.name, url]
        out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    finally:
        os.unlink(script.name)
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    errors = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
    return Load(requests=r["requests"], seconds=r["duration_us"] / 1e6, p50_ms=r["p50_us"] / 1e3,
                p99_ms=r["p99_us"] / 1e3, errors=errors)


def httpx_load(url: str, key: str, connections: int, seconds: float) -> Load:
    async def run() -> Load:
        latencies: list[float] = []
        errors = 0
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=10, limits=limits, headers=headers) as client:
            start = time.perf_counter()
            end = start + seconds

            async def loop() -> None:
                nonlocal errors
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    try:
                        ok = (await client.get(url)).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    latencies.append(time.perf_counter() - t0)
                    errors += not ok

            await asyncio.gather(*(loop() for _ in range(connections)))
            elapsed = time.perf_counter() - start
        latencies.sort()
        pick = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3) if latencies else (
            lambda q: 0.0)
        return Load(requests=len(latencies), seconds=elapsed, p50_ms=pick(0.5), p99_ms=pick(0.99), errors=errors)

    return asyncio.run(run())


# ---- the modes ----------------------------------------------------------------------------------------


def _base_env(home: Path, admin_token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")}
    env.update({"LORAPLANE_HOME": str(home), "LORAPLANE_ADMIN_TOKEN": admin_token,
                "LORAPLANE_ARTIFACT_DIR": str(home / "artifacts")})
    env.pop("LORAPLANE_DATABASE_URL", None)
    return env


@contextmanager
def mode_env(mode: str, home: Path, admin_token: str) -> Iterator[dict[str, str]]:
    env = _base_env(home, admin_token)
    if mode == "embedded":
        yield env
        return
    from cryptography.fernet import Fernet
    from sqlalchemy import create_engine, text

    run = uuid.uuid4().hex[:8]
    db = f"loraplane_bench_{run}"
    namespace = f"lp-bench-{run}"
    server = create_engine(SERVER_URL, isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db}"'))
    env.update({"DATABASE_URL": SERVER_URL.rsplit("/", 1)[0] + f"/{db}", "REDIS_URL": REDIS_URL,
                "CELERY_BROKER_URL": REDIS_URL, "LORAPLANE_NAMESPACE": namespace})
    # The distributed processes share one key for the secrets the database keeps (they refuse to start without).
    env.setdefault("LORAPLANE_SECRET_KEY", Fernet.generate_key().decode())
    try:
        yield env
    finally:
        with server.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        server.dispose()
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter(match=f"{namespace}:*"):
            r.delete(key)
        r.close()


def measure(args: argparse.Namespace, load_fn: LoadFn) -> list[list[object]]:
    rows: list[list[object]] = []
    workers = [_worker_count(w) for w in args.workers.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    for mode in args.modes.split(","):
        home = Path(tempfile.mkdtemp(prefix=f"lp-api-load-{mode}-"))
        admin_token = "lpadmin_" + secrets.token_urlsafe(16)
        try:
            with mode_env(mode, home, admin_token) as env:
                seeded: Seeded | None = None
                for n in workers:
                    with api_server(env, n, home / "api.log") as server:
                        seeded = seeded or seed(server.base, admin_token)
                        url = f"{server.base}/v1/tasks/{seeded.task_id}"
                        for count in streams:
                            rows.append(_one(args, load_fn, server, seeded, url, mode, n, count))
        finally:
            shutil.rmtree(home, ignore_errors=True)
    return rows


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, Linux /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """This process (the stream holders) and its finished children (the load generator)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _one(args: argparse.Namespace, load_fn: LoadFn, server: ApiServer, seeded: Seeded, url: str, mode: str,
         workers: int, streams: int) -> list[object]:
    with Streams(server.base, seeded, streams) as held:
        load_fn(url, seeded.key, args.connections, WARMUP_S)
        api_before, own_before, busy_before = server.cpu_s(), _own_cpu_s(), _busy_cpu_s()
        load = load_fn(url, seeded.key, args.connections, args.duration)
        api_s, own_s = server.cpu_s() - api_before, _own_cpu_s() - own_before
        # What the rest of the machine (other people's jobs, the database server) took meanwhile, in cores.
        others = max(0.0, _busy_cpu_s() - busy_before - api_s - own_s) / load.seconds
        open_at_end = held.first_event - held.ended
    api_ms = api_s * 1e3 / max(1, load.requests)
    met = load.rps >= TARGET_RPS and load.p99_ms < TARGET_P99_MS and not load.errors and open_at_end == streams
    target = ("yes" if met else "no") if streams >= TARGET_STREAMS else "-"  # the target is with 100 streams open
    print(f"{mode:>11}  workers {workers}  streams {streams:>3} (open at end {open_at_end:>3})  "
          f"{load.rps:7.0f} req/s  p50 {load.p50_ms:6.1f} ms  p99 {load.p99_ms:6.1f} ms  errors {load.errors}  "
          f"API {api_ms:.2f} CPU-ms/request, generator {own_s / load.seconds:.2f} cores, rest {others:.2f} cores",
          flush=True)
    return [mode, workers, streams, open_at_end, load.requests, round(load.rps), round(load.p50_ms, 1),
            round(load.p99_ms, 1), load.errors, round(api_ms, 2), round(own_s / load.seconds, 2), round(others, 2),
            target]


def server_stack() -> str:
    """What uvicorn will run on: its C parser and event loop when installed (`uvicorn[standard]`), else h11 and
    asyncio (what loraplane's own dependencies give)."""
    import uvicorn

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn {uvicorn.__version__} ({http}, {loop}), access log on"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="embedded,distributed", help="comma list of embedded, distributed")
    parser.add_argument("--workers", default="1,auto", help="comma list of API worker counts (auto: one per core)")
    parser.add_argument("--streams", default="100", help="comma list of SSE streams held open while polling")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per measurement")
    parser.add_argument("--tag", default="", help="added to the result file's name (api_load-<tag>-cpu-<date>.json)")
    args = parser.parse_args()
    generator = "wrk" if shutil.which("wrk") else "httpx (wrk not found: the load generator takes more CPU)"
    load_fn = wrk_load if shutil.which("wrk") else httpx_load
    print(f"server: {server_stack()}", flush=True)
    print(f"load generator: {generator}; {args.connections} connections, {args.duration:g} s per measurement "
          f"after {WARMUP_S:g} s of warm-up. The generator, the stream holders and the API share this "
          f"machine's {_cores()} cores.", flush=True)
    rows = measure(args, load_fn)
    headers = ["mode", "workers", "sse_streams", "streams_open_at_end", "requests", "req_per_s", "p50_ms", "p99_ms",
               "errors", "api_cpu_ms_per_req", "generator_cores", "rest_cores", "target_met"]
    write_result(f"api_load-{args.tag}" if args.tag else "api_load", headers, rows, {
        "endpoint": "GET /v1/tasks/{id} (8 trials), one API key",
        "server": server_stack(),
        "load_generator": generator,
        "connections": args.connections,
        "duration_s": args.duration,
        "warmup_s": WARMUP_S,
        "target": f">= {TARGET_RPS:g} req/s with p99 < {TARGET_P99_MS:g} ms, {TARGET_STREAMS} SSE streams open",
        "shared_cpu": f"the load generator, the SSE stream holders and the API share the machine's {_cores()} "
                      "cores (loopback)",
        "columns": {
            "api_cpu_ms_per_req": "CPU time of the API's processes (all workers) during the measurement / requests",
            "generator_cores": "CPU the load generator and the SSE stream holders took, in cores",
            "rest_cores": "CPU everything else took meanwhile, in cores: the database server (distributed) and "
                          "any other job on the machine",
        },
    })


if __name__ == "__main__":
    main()
