"""The artifact store: uploaded datasets and trained adapters, addressed by key.

Local directory by default (shared by the API, scheduler and workers on one host, or a shared
volume). Writes are atomic (temp file + rename) so a reader never sees a half-written object. What the
store creates is its owner's alone: 0700 directories, 0600 objects (`mkstemp` creates them so).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

from common.private_files import private_dir
from common.settings import get_settings


class StagedObject:
    """An object written piece by piece under a temporary name beside its key: readers see nothing until
    `publish()` renames it into place; `discard()` removes it. One of the two must end every staging."""

    def __init__(self, key: str, target: Path, fd: int, tmp: str) -> None:
        self.key = key
        self.size = 0
        self._target = target
        self._tmp = tmp
        self._file = os.fdopen(fd, "wb")

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self.size += data.nbytes if isinstance(data, memoryview) else len(data)

    def sync(self) -> None:
        """Makes what was written durable and ends the writing: `publish()` after it only renames."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def publish(self) -> None:
        self.sync()
        os.replace(self._tmp, self._target)

    def discard(self) -> None:
        self._file.close()
        Path(self._tmp).unlink(missing_ok=True)


class LocalArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        private_dir(root)

    def path(self, key: str) -> Path:
        target = (self.root / key).resolve()
        if self.root.resolve() not in target.parents:
            raise ValueError(f"artifact key escapes the store: {key!r}")
        return target

    def _atomic_target(self, key: str) -> tuple[Path, int, str]:
        target = self.path(key)
        private_dir(target.parent)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")  # 0600
        return target, fd, tmp

    def stage(self, key: str) -> StagedObject:
        """A new object for `key`, written in pieces (an upload as it arrives), invisible until published."""
        return StagedObject(key, *self._atomic_target(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        self.put_written(key, lambda staged: staged.write(data))

    def put_written(self, key: str, write: Callable[[StagedObject], object]) -> int:
        """The object ``write`` writes into a staging of ``key``, published once it returned (discarded if it
        raised); its size."""
        staged = self.stage(key)
        try:
            write(staged)
            staged.publish()
        except BaseException:
            staged.discard()
            raise
        return staged.size

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

    def keys(self, prefix: str) -> list[str]:
        """The keys of the objects directly under the folder ``prefix``, sorted (none while it does not exist)."""
        folder = self.path(prefix)
        if not folder.is_dir():
            return []
        return sorted(f"{prefix}/{p.name}" for p in folder.iterdir() if p.is_file() and not p.name.startswith(".tmp-"))


@lru_cache
def get_artifact_store() -> LocalArtifactStore:
    return LocalArtifactStore(get_settings().resolved_artifact_dir)


def file_key(file_id: str) -> str:
    return f"files/{file_id}.jsonl"


def adapter_key(task_id: str, trial_id: str) -> str:
    return f"adapters/{task_id}/{trial_id}.tar.gz"


# What a trial's exports are stored as (built once on request by a worker: worker/exports.py): the base with the
# adapter merged in, a directory as .tar.gz; the adapter as a llama.cpp LoRA GGUF.
EXPORT_FILES = {"merged": "merged.tar.gz", "gguf": "adapter.gguf"}


def export_key(task_id: str, trial_id: str, export_format: str) -> str:
    return f"exports/{task_id}/{trial_id}/{EXPORT_FILES[export_format]}"


def export_failure_key(task_id: str, trial_id: str, export_format: str) -> str:
    """Why the export could not be built (JSON ``{"error": ...}``), until it is asked for again."""
    return f"exports/{task_id}/{trial_id}/{export_format}.failed.json"


def export_requested_key(task_id: str, trial_id: str, export_format: str) -> str:
    """When the API last asked the workers to build the export, under which request id, and why it asked again
    (JSON, `common.export_builds.BuildRequest`)."""
    return f"exports/{task_id}/{trial_id}/{export_format}.requested.json"


def export_claimed_key(task_id: str, trial_id: str, export_format: str) -> str:
    """The worker process that took the build (JSON, `common.export_builds.BuildClaim`): the API sends the build
    again once that process is gone."""
    return f"exports/{task_id}/{trial_id}/{export_format}.claimed.json"


def saved_checkpoint_key(task_id: str, trial_id: str, step: int) -> str:
    """A trial's adapter at ``step``, kept for users (common/checkpoints.py): its PEFT directory as a plain .tar
    (fp32 weights do not compress; gzip only cost the pack's writer time)."""
    return f"{saved_checkpoints_prefix(task_id, trial_id)}/step-{step:09d}.tar"


def saved_checkpoints_prefix(task_id: str, trial_id: str) -> str:
    return f"adapter-checkpoints/{task_id}/{trial_id}"


def saved_checkpoint_step(key: str) -> int:
    """The step of a ``saved_checkpoint_key``."""
    return int(key.rsplit("/step-", 1)[1].split(".", 1)[0])


def checkpoint_key(task_id: str, trial_id: str, step: int) -> str:
    # One key per step: the database's (key, step) pointer must never find a newer checkpoint at its key
    # (a worker killed between writing one and reporting it would otherwise leave exactly that).
    return f"checkpoints/{task_id}/{trial_id}/step-{step:09d}.tar"
