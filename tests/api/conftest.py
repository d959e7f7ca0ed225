"""A fresh app per test over the suite's migrated database, emptied before and after (`clean_db`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.factories import TenantKey, make_tenant


@pytest.fixture
def client(clean_db: None) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:  # `with`: runs the lifespan, which seeds the model registry
        yield c


@pytest.fixture
def tenant(client: TestClient) -> TenantKey:
    return make_tenant(client, "acme")


@pytest.fixture
def other_tenant(client: TestClient) -> TenantKey:
    return make_tenant(client, "globex")
