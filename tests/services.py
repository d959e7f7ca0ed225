"""Finds the PostgreSQL and Redis servers the suite talks to, or starts them.

Order: DATABASE_URL / REDIS_URL from the environment; else the usual local ports; else start a
throwaway server from the binaries on this machine (initdb/pg_ctl, redis-server) under .test-services/;
else stop with a message that says what is missing.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_DIR = ROOT / ".test-services"


class MissingService(RuntimeError):
    pass


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _port_open("127.0.0.1", port):
            return
        time.sleep(0.2)
    raise MissingService(f"{what} did not start listening on 127.0.0.1:{port}")


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _as_postgres_user() -> list[str]:
    """The prefix that runs a PostgreSQL program: postgres refuses to run as root."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class PostgresServer:
    """A PostgreSQL server of our own: its data in `data` (initdb'd on the first start, trust auth), listening on
    127.0.0.1:`port`. It can be stopped (`mode` "immediate" is a crash) and started again on the same data.
    When root, `data`'s parent must be writable by the postgres user."""

    def __init__(self, data: Path, port: int) -> None:
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not (initdb and pg_ctl):
            raise MissingService(
                "no PostgreSQL: set DATABASE_URL, run one on 127.0.0.1:5432, or install the server "
                "(apt-get install postgresql) so the suite can start its own"
            )
        self.initdb, self.pg_ctl = initdb, pg_ctl
        self.data = data
        self.port = port
        self.log_path = data.parent / f"{data.name}.log"

    @property
    def url(self) -> str:
        """A server-level URL (database `postgres`)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        user = _as_postgres_user()
        if not (self.data / "PG_VERSION").exists():
            subprocess.run([*user, self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust"], check=True,
                           capture_output=True)
        subprocess.run(
            [*user, self.pg_ctl, "-D", str(self.data), "-l", str(self.log_path), "-w",
             "-o", f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1", "start"],
            check=True, capture_output=True,
        )
        _wait_port(self.port, "PostgreSQL")

    def stop(self, mode: str = "fast") -> None:
        subprocess.run([*_as_postgres_user(), self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"],
                       check=True, capture_output=True)

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


def find_postgres() -> str:
    """A server-level URL (database `test` or `postgres`) the suite may create databases on."""
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    if _port_open("127.0.0.1", 5432):
        return "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    server = PostgresServer(RUN_DIR / "pg", _free_port())
    RUN_DIR.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(RUN_DIR, "postgres")
    server.start()
    return server.url


def redis_server_argv(port: int, workdir: Path) -> list[str]:
    """A redis-server in the foreground on 127.0.0.1:`port` that persists nothing: a restart starts empty."""
    server = shutil.which("redis-server")
    if not server:
        raise MissingService(
            "no Redis: set REDIS_URL, run one on 127.0.0.1:6379, or install it (apt-get install redis-server) "
            "so the suite can start its own"
        )
    return [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]


def find_redis() -> str:
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    if _port_open("127.0.0.1", 6379):
        return "redis://127.0.0.1:6379/0"
    port = _free_port()
    RUN_DIR.mkdir(exist_ok=True)
    argv = redis_server_argv(port, RUN_DIR)
    subprocess.run([*argv, "--daemonize", "yes", "--logfile", str(RUN_DIR / "redis.log")], check=True)
    _wait_port(port, "Redis")
    return f"redis://127.0.0.1:{port}/0"


def find_rabbitmq() -> str:
    """An AMQP URL for the Celery broker tests (RabbitMQ is optional for loraplane: Redis is the default)."""
    if os.environ.get("RABBITMQ_URL"):
        return os.environ["RABBITMQ_URL"]
    if _port_open("127.0.0.1", 5672):
        return "amqp://guest:guest@127.0.0.1:5672//"
    server = shutil.which("rabbitmq-server") or "/usr/sbin/rabbitmq-server"
    if not Path(server).exists():
        raise MissingService("no RabbitMQ: set RABBITMQ_URL, run one on 127.0.0.1:5672, or install "
                             "rabbitmq-server so the suite can start it")
    subprocess.run([server, "-detached"], check=True, capture_output=True)
    _wait_port(5672, "RabbitMQ", seconds=60)
    return "amqp://guest:guest@127.0.0.1:5672//"
