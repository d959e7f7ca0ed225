"""A fresh app per test over the suite's migrated database, emptied before and after (`clean_db`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.egress import TableResolver
from tests.factories import TenantKey, make_tenant


@pytest.fixture
def resolver() -> TableResolver:
    """How the app resolves webhook host names: from a table, never through DNS (tests/egress.py)."""
    return TableResolver()


@pytest.fixture
def client(clean_db: None, resolver: TableResolver) -> Iterator[TestClient]:
    from api.deps import name_resolver
    from api.main import create_app

    app = create_app()
    app.dependency_overrides[name_resolver] = lambda: resolver
    with TestClient(app) as c:  # `with`: runs the lifespan, which seeds the model registry
        yield c


@pytest.fixture
def tenant(client: TestClient) -> TenantKey:
    return make_tenant(client, "acme")


@pytest.fixture
def other_tenant(client: TestClient) -> TenantKey:
    return make_tenant(client, "globex")
