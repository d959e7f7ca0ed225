"""The real API app served by uvicorn on a free port in this process (one server for the session, over the
suite's migrated database, emptied around each test by `clean_db`), and tenants made through it.

The client and the CLI talk to it over real HTTP: SSE streams, multipart uploads and downloads included.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ADMIN_TOKEN
from tests.e2e.procs import app_in_thread
from tests.factories import TenantKey, make_tenant


@pytest.fixture(scope="session")
def api_url(database: str) -> Iterator[str]:
    with app_in_thread() as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def isolated_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test reads the developer's own config file or LORAPLANE_API_* variables."""
    path = tmp_path / "config" / "loraplane.json"
    monkeypatch.setenv("LORAPLANE_CONFIG", str(path))
    monkeypatch.delenv("LORAPLANE_API_URL", raising=False)
    monkeypatch.delenv("LORAPLANE_API_KEY", raising=False)
    assert os.environ["LORAPLANE_ADMIN_TOKEN"] == ADMIN_TOKEN
    return path


@pytest.fixture
def tenant(clean_db: None, api_url: str) -> TenantKey:
    with httpx.Client(base_url=api_url) as http:
        return make_tenant(http, "acme")  # type: ignore[arg-type]


@pytest.fixture
def other_tenant(tenant: TenantKey, api_url: str) -> TenantKey:
    with httpx.Client(base_url=api_url) as http:
        return make_tenant(http, "globex")  # type: ignore[arg-type]
