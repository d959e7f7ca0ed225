"""Starts loraplane's real processes (`loraplane api|scheduler|worker|up`) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


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
        proc = Proc(name, [sys.executable, "-m", "loraplane.cli", *args], self.env, self.log_dir)
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n\n".join(f"----- {p.name} -----\n{p.tail()}" for p in self.procs)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def wait_ready(base_url: str, procs: list[Proc], seconds: float = 90) -> None:
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
