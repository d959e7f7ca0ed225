"""Fixtures for the training engine: the tiny random Llama, materialised once per session into a tmp dir."""

from __future__ import annotations

import os
import shutil

if shutil.which("nvidia-smi") is None:  # as in tests/conftest.py, for runs that skip it (--confcutdir); it must
    os.environ.setdefault("TRITON_INTERPRET", "1")  # be set before anything imports Triton

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from transformers import PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from tests.engine.factories import CPU, TINY  # noqa: E402
from worker.engine import load_base_model, restore_base_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def database() -> str:
    """The engine touches no database: this overrides the suite's autouse Postgres fixture here, so the
    engine tests also run where only torch/transformers are installed (the GPU image)."""
    return ""


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def _tiny_session(model_cache: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_base_model(TINY, cache_dir=model_cache, device=CPU)


@pytest.fixture
def tiny(
    _tiny_session: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> Iterator[tuple[PreTrainedModel, PreTrainedTokenizerBase]]:
    """The shared tiny model; any adapter layer a test leaves behind is removed afterwards."""
    yield _tiny_session
    restore_base_model(_tiny_session[0])


@pytest.fixture
def fresh_tiny(model_cache: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A second, untouched copy of the tiny model (for PEFT, which injects its own layers)."""
    return load_base_model(TINY, cache_dir=model_cache, device=CPU)
