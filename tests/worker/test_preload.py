"""LORAPLANE_WORKER_PRELOAD: a worker loads the named registry models before its first pack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.engine import ModelSource, load_base_model
from worker.model_cache import preload_models


def test_named_registry_models_are_loaded_and_unknown_names_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded: dict[str, object] = {}

    def load(source: ModelSource) -> object:  # what PackRunner.model does: load once, keep
        loaded[source.name] = load_base_model(source, cache_dir=tmp_path, device=torch.device("cpu"))
        return loaded[source.name]

    preload_models(load, " tiny-random-llama , no-such-model,")
    assert list(loaded) == ["tiny-random-llama"]
    assert "no-such-model" in caplog.text
    preload_models(load, "")  # the default: nothing
    assert list(loaded) == ["tiny-random-llama"]
