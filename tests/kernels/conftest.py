"""The kernels touch no database and need no model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def database() -> str:
    """Overrides the suite's autouse Postgres fixture: kernel tests run where only torch is installed."""
    return ""
