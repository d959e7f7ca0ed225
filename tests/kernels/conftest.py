"""The kernels touch no database and need no model."""

from __future__ import annotations

import os
import shutil

import pytest

if shutil.which("nvidia-smi") is None:  # as in tests/conftest.py, for runs that skip it (--confcutdir)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def database() -> str:
    """Overrides the suite's autouse Postgres fixture: kernel tests run where only torch is installed."""
    return ""
