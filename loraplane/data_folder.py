"""One service per embedded data folder, and the API processes' own memory bound: two guards `loraplane up`, `api`
and `scheduler` take before they serve.

The data folder (LORAPLANE_HOME) holds a SQLite database, the bus and the broker's files. Two services on one
folder share none of their in-process state: two schedulers plan the same trials, and one service's SQLite
checkpoint can remove the write-ahead log under the other's open connections (seen once: a task created
through one was 404 through the other, issue 52). So the embedded service holds an exclusive lock on a file in the
folder while it runs, and a second one stops at once, naming the first. More API processes on one folder are
`loraplane api --workers N` (or `up`'s own), which run under the one lock; the distributed mode (DATABASE_URL set)
takes no lock, as its processes share PostgreSQL by design.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = "service.lock"


class DataFolderInUse(RuntimeError):
    """Another service holds the data folder's lock; the message names it and what to do."""


@contextlib.contextmanager
def hold_data_folder(home: Path, what: str) -> Iterator[None]:
    """Holds `home`'s lock while the block runs (released when the process ends, even by SIGKILL: it is an
    open file's lock, and the file is not inherited by child processes).

    Raises:
        DataFolderInUse: another process holds it; the message says which (its pid and command, as it wrote them).
    """
    home.mkdir(parents=True, exist_ok=True)
    path = home / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise DataFolderInUse(
                f"the data folder {home.resolve()} is in use by another loraplane service ({holder}). Stop it "
                "first, or give this one a folder of its own (LORAPLANE_HOME). To serve the API from more "
                "processes, use `loraplane api --workers N` (one service, one lock).") from None
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
