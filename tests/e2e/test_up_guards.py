"""`loraplane up`'s guards (issue 52): its API server runs in a process of its own under the API's memory bound
and is started again when it dies, the scheduler and the worker untouched; a data folder has one API and one
scheduler at a time (`up` is both), and a second of either stops at once saying which holds the folder. Real
processes, the embedded default, no worker (none of this needs one). `loraplane api` beside `loraplane scheduler`
on one folder, the other way to run it, is tests/api/test_api_webhooks.py's SQLite delivery test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.flow import wait_for
from tests.e2e.procs import (
    EMBEDDED_UNSET,
    ROOT,
    START_CEILING_S,
    child_pids,
    cluster,
    cmdline,
    distributed_env,
    free_port,
    wait_ready,
)

LIMIT_MB = 3072


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(home), "LORAPLANE_API_MEMORY_LIMIT_MB": str(LIMIT_MB)})
    return env


def _api_server(up_pid: int) -> int:
    """The API server process `up` started (multiprocessing's spawned child; its resource tracker is not it)."""
    servers = [p for p in child_pids(up_pid) if "spawn_main" in " ".join(cmdline(p))]
    assert len(servers) == 1, [cmdline(p) for p in child_pids(up_pid)]
    return servers[0]


def _address_space_limit(pid: int) -> int | None:
    """The process's soft address-space limit in bytes (None: unlimited)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            soft = line.split()[3]
            return None if soft == "unlimited" else int(soft)
    raise AssertionError(f"no address-space limit line for {pid}")


def _loraplane(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loraplane.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_up_bounds_its_api_process_restarts_it_and_holds_its_data_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = _env(home)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp_path) as c:
        up = c.start("up", "up", "--port", str(port), "--no-worker")
        wait_ready(base_url, [up])
        server = _api_server(up.proc.pid)
        # The bound is the API process's own: `up` itself (the scheduler) and what it starts later are not under it.
        assert _address_space_limit(server) == LIMIT_MB << 20
        assert _address_space_limit(up.proc.pid) != LIMIT_MB << 20

        # A second service on the same folder stops at once, naming the one that holds it, and writes nothing.
        for command in (["up", "--port", str(free_port()), "--no-worker"], ["api", "--port", str(free_port())],
                        ["scheduler"]):
            refused = _loraplane(env, *command)
            assert refused.returncode != 0, refused.stdout
            role = command[0] if command[0] != "up" else "api"
            assert f"already has its {role} (pid {up.proc.pid}: loraplane up)" in refused.stderr, \
                refused.stderr[-1500:]
        assert httpx.get(f"{base_url}/readyz", timeout=10).status_code == 200

        # An API process that dies (the memory bound ends one the same way) is started again; `up` goes on.
        os.kill(server, signal.SIGKILL)
        wait_for(lambda: server not in child_pids(up.proc.pid), START_CEILING_S, "the killed API process to go")
        wait_ready(base_url, [up])
        restarted = _api_server(up.proc.pid)
        assert restarted != server and _address_space_limit(restarted) == LIMIT_MB << 20
        assert up.alive()
        assert f"API process {server} exited with -9; starting another" in up.log_path.read_text()

        # Stopped, it lets the folder go: the next service takes it.
        up.stop()
        again = c.start("up-again", "api", "--host", "127.0.0.1", "--port", str(port))
        wait_ready(base_url, [again])
        assert (home / "api.lock").read_text().startswith(f"pid {again.proc.pid}: loraplane api")
        # The other half of the service may join it, not a second of the same half.
        scheduler = c.start("scheduler", "scheduler")
        wait_for(lambda: "scheduler running" in scheduler.log_path.read_text(), START_CEILING_S, "the scheduler")
        second = _loraplane(env, "api", "--port", str(free_port()))
        assert second.returncode != 0 and f"already has its api (pid {again.proc.pid}" in second.stderr


def test_the_distributed_mode_takes_no_lock(tmp_path: Path) -> None:
    # Its processes share PostgreSQL by design: two API servers with the same LORAPLANE_HOME both serve.
    env = distributed_env(tmp_path)
    with cluster(env, tmp_path) as c:
        ports = [free_port(), free_port()]
        apis = [c.start(f"api-{i}", "api", "--host", "127.0.0.1", "--port", str(port)) for i, port in enumerate(ports)]
        for port, api in zip(ports, apis, strict=True):
            wait_ready(f"http://127.0.0.1:{port}", [api])
        assert not (Path(env["LORAPLANE_HOME"]) / "api.lock").exists()
