"""Starts loraplane's real processes (`loraplane api|scheduler|worker|up`) for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
# The bound on waiting for what has no progress to measure (a process to start or appear, a server to answer): far
# longer than a start takes on two cores busy with other jobs. Waits on work in progress: tests/e2e/flow.py.
START_CEILING_S = 300.0


@contextmanager
def app_in_thread() -> Iterator[int]:
    """The API app served by uvicorn in a thread of this process on a free loopback port (yielded), stopped after."""
    import threading

    import uvicorn

    from api.main import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name="api-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_CEILING_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the API server did not start")
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def distributed_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment (DATABASE_URL, REDIS_URL, ...) plus what a short distributed e2e run wants: a
    namespace of its own on the shared Redis, files under `tmp_path`, fast ticks, heartbeats, timeouts, requeue
    backoffs and checkpoints."""
    env = dict(os.environ)
    env.update({
        "LORAPLANE_NAMESPACE": f"lp-e2e-{uuid.uuid4().hex[:8]}",
        "LORAPLANE_HOME": str(tmp_path / "home"),
        "LORAPLANE_ARTIFACT_DIR": str(tmp_path / "artifacts"),
        "LORAPLANE_SCHEDULER_TICK_S": "0.5",
        "LORAPLANE_HEARTBEAT_S": "1",
        "LORAPLANE_WORKER_TIMEOUT_S": "8",
        # Checkpoints every 0.2 s, not every minute: the tests that kill a worker find a checkpoint to resume from
        # within a few steps of training, as they did when checkpoints came at each validation.
        "LORAPLANE_CHECKPOINT_INTERVAL_S": "0.2",
        # A trial requeued by a worker's loss may be placed again after 1 s, not the default 5 s (the tests that kill
        # a worker wait for that before training resumes; none tests the backoff's length).
        "LORAPLANE_REQUEUE_BACKOFF_S": "1",
    })
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        # A new session, so killing the process group takes the children (uvicorn, a worker) with it.
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        else:
            # The leader died alone (a test killed only it): what is left of its group (a child it should have
            # taken with it) must not outlive the test. A pid is never reused while its group has members.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()

    def tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


class Cluster:
    """A set of loraplane processes sharing one environment."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, *args: str) -> Proc:
        """`loraplane <args>` as a process named `name` (its log file's name: unique in the cluster)."""
        return self.run(name, [sys.executable, "-m", "loraplane.cli", *args])

    def run(self, name: str, argv: list[str]) -> Proc:
        """Any program (a private redis-server), its log shown with the others'."""
        proc = Proc(name, argv, self.env, self.log_dir)
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n\n".join(f"----- {p.name} -----\n{p.tail()}" for p in self.procs)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def wait_ready(base_url: str, procs: list[Proc], seconds: float = START_CEILING_S) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited early:\n{p.tail()}")
        try:
            if httpx.get(f"{base_url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{base_url} not ready after {seconds}s")


@contextmanager
def cluster(env: dict[str, str], log_dir: Path) -> Iterator[Cluster]:
    c = Cluster(env, log_dir)
    try:
        yield c
    except BaseException:
        sys.stderr.write(c.logs())
        raise
    finally:
        c.stop_all()


# What `loraplane up` must not inherit from the suite's environment to run on its embedded default (SQLite, a file
# bus and broker, local artifacts, a generated admin token).
EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ADMIN_TOKEN",
                  "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE")


def start_embedded(c: Cluster, port: int, worker_id: str = "embedded") -> tuple[Proc, str]:
    """`loraplane up` (the embedded default) as a process of ``c``: the process and the admin token it generated
    (read from the box it prints), once its API answers."""
    up = c.start("up", "up", "--port", str(port), "--worker-id", worker_id)
    wait_ready(f"http://127.0.0.1:{port}", [up])
    deadline = time.monotonic() + START_CEILING_S
    while time.monotonic() < deadline:
        if found := re.search(r"^\|\s+(lpadmin_\S+)\s+\|$", up.log_path.read_text(), re.MULTILINE):
            return up, found.group(1)
        time.sleep(0.5)
    raise TimeoutError("no admin token in the box `up` prints")


@contextmanager
def embedded_service(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`loraplane up` on its embedded default under ``tmp_path`` (a free port, a half-second scheduler tick, a
    one-second heartbeat): yields its base URL and the admin token it generated; its logs are printed if the body
    raises, and it is stopped after."""
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_SCHEDULER_TICK_S": "0.5",
                "LORAPLANE_HEARTBEAT_S": "1"})
    port = free_port()
    with cluster(env, tmp_path) as c:
        _, token = start_embedded(c, port)
        yield f"http://127.0.0.1:{port}", token


def start_control_plane(c: Cluster) -> str:
    """The API and the scheduler as separate processes of ``c``; returns the API's URL once it answers."""
    port = free_port()
    api = c.start("api", "api", "--host", "127.0.0.1", "--port", str(port))
    c.start("scheduler", "scheduler")
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, [api])
    return base_url


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has exited already). From /proc, as psutil may
    not be installed."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def child_pids(pid: int) -> list[int]:
    """The live children of `pid`, of all its threads."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return [c for c in children if running(c)]


def is_worker(pid: int) -> bool:
    """Runs `loraplane worker` (`python -m loraplane.cli worker ...`)."""
    argv = cmdline(pid)
    return "loraplane.cli" in argv and "worker" in argv


def workers_of_home(home: Path) -> list[int]:
    """Every live `loraplane worker` process on this machine whose LORAPLANE_HOME is `home` (so another test
    running beside this one is never counted)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not is_worker(int(entry.name)) or not running(int(entry.name)):
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if f"LORAPLANE_HOME={home}".encode() in environ:
            found.append(int(entry.name))
    return found
