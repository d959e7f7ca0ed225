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


def find_postgres() -> str:
    """A server-level URL (database `test` or `postgres`) the suite may create databases on."""
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    if _port_open("127.0.0.1", 5432):
        return "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        raise MissingService(
            "no PostgreSQL: set DATABASE_URL, run one on 127.0.0.1:5432, or install the server "
            "(apt-get install postgresql) so the suite can start its own"
        )
    data = RUN_DIR / "pg"
    port = _free_port()
    user_args: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        user_args = ["runuser", "-u", "postgres", "--"]
        RUN_DIR.mkdir(exist_ok=True)
        shutil.chown(RUN_DIR, "postgres")
    if not (data / "PG_VERSION").exists():
        subprocess.run([*user_args, initdb, "-D", str(data), "-U", "postgres", "--auth=trust"], check=True,
                       capture_output=True)
    subprocess.run(
        [*user_args, pg_ctl, "-D", str(data), "-l", str(RUN_DIR / "pg.log"), "-w",
         "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"],
        check=True, capture_output=True,
    )
    _wait_port(port, "PostgreSQL")
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"


def find_redis() -> str:
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    if _port_open("127.0.0.1", 6379):
        return "redis://127.0.0.1:6379/0"
    server = shutil.which("redis-server")
    if not server:
        raise MissingService(
            "no Redis: set REDIS_URL, run one on 127.0.0.1:6379, or install it (apt-get install redis-server) "
            "so the suite can start its own"
        )
    port = _free_port()
    RUN_DIR.mkdir(exist_ok=True)
    subprocess.run(
        [server, "--daemonize", "yes", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no", "--dir", str(RUN_DIR), "--logfile", str(RUN_DIR / "redis.log")],
        check=True,
    )
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
