"""A merged build that cannot be made says why at its failure key (the API reports it once, then asks again), and one
already stored is not built twice (worker/exports.py; the merge itself: tests/e2e/test_export.py)."""

from __future__ import annotations

import json
from pathlib import Path

from common.artifacts import LocalArtifactStore, merged_failure_key, merged_key
from common.messages import ExportRequest, ModelSourceFields
from worker.exports import build_merged

TINY = ModelSourceFields(name="tiny-random-llama", kind="tiny-random-llama")


def request(adapter_key: str) -> ExportRequest:
    return ExportRequest(task_id="task-1", trial_id="trial-1", adapter_key=adapter_key, base_model=TINY)


def test_a_build_without_its_adapter_stores_why_and_no_archive(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    build_merged(request("adapters/task-1/gone.tar.gz"), store=store, cache_dir=tmp_path / "models")
    assert not store.exists(merged_key("task-1", "trial-1"))
    error = json.loads(store.get_bytes(merged_failure_key("task-1", "trial-1")))["error"]
    assert error.startswith("FileNotFoundError"), error


def test_a_build_already_stored_is_not_made_again(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    store.put_bytes(merged_key("task-1", "trial-1"), b"built before")
    build_merged(request("adapters/task-1/gone.tar.gz"), store=store, cache_dir=tmp_path / "models")
    assert store.get_bytes(merged_key("task-1", "trial-1")) == b"built before"
    assert not store.exists(merged_failure_key("task-1", "trial-1"))
