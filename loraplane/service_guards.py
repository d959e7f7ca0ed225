"""One API and one scheduler per embedded data folder, and the API processes' own memory bound: two guards
`loraplane up`, `api` and `scheduler` take before they serve.

The data folder (LORAPLANE_HOME) holds a SQLite database, the bus and the broker's files. One API service and one
scheduler use it together (`up` is both; `loraplane api` and `loraplane scheduler` are the two halves). A second of
either shares none of the first's in-process state: two schedulers plan the same trials, and a second API beside
`up` once answered 404 for a task created through the first (issue 52). So each role holds an exclusive lock on a
file of its own in the folder while it runs (`up` holds both), and a second service of a role stops at once, naming
the first. More API processes on one folder are `loraplane api --workers N` (or `up`'s own), which run under the
one lock; the distributed mode (DATABASE_URL set) takes no lock, as its processes share PostgreSQL by design.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
from collections.abc import Iterator
from pathlib import Path

ROLES = ("api", "scheduler")  # each role's lock is `<role>.lock` in the folder


class DataFolderInUse(RuntimeError):
    """Another service holds the data folder's lock; the message names it and what to do."""


@contextlib.contextmanager
def hold_data_folder(home: Path, what: str, roles: tuple[str, ...]) -> Iterator[None]:
    """Holds `home`'s lock of each of `roles` (of ROLES) while the block runs (released when the process ends, even
    by SIGKILL: they are open files' locks, and the files are not inherited by child processes).

    Raises:
        DataFolderInUse: another process holds one; the message says which (its pid and command, as it wrote them).
    """
    home.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        for role in roles:
            stack.enter_context(_holding(home, role, what))
        yield


@contextlib.contextmanager
def _holding(home: Path, role: str, what: str) -> Iterator[None]:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    fd = os.open(home / f"{role}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise DataFolderInUse(
                f"the data folder {home.resolve()} already has its {role} ({holder}). Stop it first, or give this "
                "one a folder of its own (LORAPLANE_HOME). To serve the API from more processes, use `loraplane api "
                "--workers N` (one service, one lock).") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: loraplane {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def limit_api_memory(limit_mb: int) -> None:
    """This API process's address space at most `limit_mb` MiB (0: unchanged), and never above a limit it was
    started under: a request that would take more fails in this process alone (a MemoryError, answered as a
    500), not the machine (issue 52)."""
    if limit_mb <= 0:
        return
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = limit_mb << 20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
