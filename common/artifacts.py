"""The artifact store: uploaded datasets and trained adapters, addressed by key.

Local directory by default (shared by the API, scheduler and workers on one host, or a shared
volume). Writes are atomic (temp file + rename) so a reader never sees a half-written object.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

from common.settings import get_settings


class LocalArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        target = (self.root / key).resolve()
        if self.root.resolve() not in target.parents:
            raise ValueError(f"artifact key escapes the store: {key!r}")
        return target

    def _atomic_target(self, key: str) -> tuple[Path, int, str]:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        return target, fd, tmp

    def put_bytes(self, key: str, data: bytes) -> None:
        target, fd, tmp = self._atomic_target(key)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def put_file(self, key: str, source: Path) -> None:
        target, fd, tmp = self._atomic_target(key)
        with os.fdopen(fd, "wb") as f, source.open("rb") as src:
            shutil.copyfileobj(src, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def get_bytes(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def open(self, key: str) -> BinaryIO:
        return self.path(key).open("rb")

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)


@lru_cache
def get_artifact_store() -> LocalArtifactStore:
    return LocalArtifactStore(get_settings().resolved_artifact_dir)


def file_key(file_id: str) -> str:
    return f"files/{file_id}.jsonl"


def adapter_key(task_id: str, trial_id: str) -> str:
    return f"adapters/{task_id}/{trial_id}.tar.gz"


def checkpoint_key(task_id: str, trial_id: str, step: int) -> str:
    # One key per step: the database's (key, step) pointer must never find a newer checkpoint at its key
    # (a worker killed between writing one and reporting it would otherwise leave exactly that).
    return f"checkpoints/{task_id}/{trial_id}/step-{step:09d}.tar"
