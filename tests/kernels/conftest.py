"""The kernels touch no database and need no model."""

from __future__ import annotations

import os
import shutil

import pytest

if shutil.which("nvidia-smi") is None:  # as in tests/conftest.py, for runs that skip it (--confcutdir)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One fixed tile configuration per kernel: autotuning every new test shape on a GPU takes minutes of
# compiling (the benchmarks check the tuned configurations against the torch path on every row).
os.environ.setdefault("LORAPLANE_TRITON_AUTOTUNE", "0")


@pytest.fixture(scope="session")
def database() -> str:
    """Overrides the suite's autouse Postgres fixture: kernel tests run where only torch is installed."""
    return ""
