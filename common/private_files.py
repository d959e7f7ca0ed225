"""The service's own data on disk is readable by its owner only: 0700 directories, 0600 files.

Modes are set explicitly where each directory or file is created rather than through a process umask, so
they hold whatever umask the operator's shell has. A directory that already exists keeps its mode (the
operator chose it: a shared artifact volume, a home they made themselves); a file of ours that already
exists (a database from an older version) is narrowed to 0600.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def private_dir(path: Path) -> Path:
    """Creates `path` and each missing parent as 0700 (`mkdir -p` would give the parents the umask's mode)."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:  # another process made it meanwhile; it is theirs to have set up
            continue
        os.chmod(directory, DIR_MODE)  # mkdir's mode is narrowed by the umask; this one is not
    return path


def private_file(path: Path) -> Path:
    """Creates `path` empty as 0600 if it is missing; narrows an existing one to 0600. Content is untouched."""
    private_dir(path.parent)
    fd = os.open(path, os.O_CREAT | os.O_RDONLY, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return path


def private_sqlite_file(path: Path) -> Path:
    """A SQLite database file, 0600 before SQLite first opens it: SQLite gives the WAL, shared-memory and
    journal files it creates the database file's mode. Side files left by an older version are narrowed too."""
    private_file(path)
    for suffix in SQLITE_SIDE_FILES:
        try:
            os.chmod(path.with_name(path.name + suffix), FILE_MODE)
        except FileNotFoundError:  # none, or SQLite removed it as its last connection closed
            continue
    return path
