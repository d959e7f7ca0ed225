from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine


def test_healthz_answers_ok(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_readyz_ready_when_database_and_bus_answer(client: TestClient) -> None:
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "checks": {"database": "ok", "bus": "ok"}}


def test_readyz_503_names_the_bus_when_it_is_down(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    class DeadBus:
        def ping(self) -> bool:
            raise ConnectionError("refused")

    monkeypatch.setattr("api.routes.health.get_bus", lambda: DeadBus())
    r = client.get("/readyz")
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "not_ready"
    assert error["checks"] == {"database": "ok", "bus": "error: ConnectionError"}


def test_readyz_503_names_the_database_when_it_is_down(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none", connect_args={"connect_timeout": 2})
    monkeypatch.setattr("api.routes.health.get_engine", lambda: dead)
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["error"]["checks"]["database"].startswith("error:")
    assert r.json()["error"]["checks"]["bus"] == "ok"


def test_openapi_and_docs_are_served(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert "/v1/tasks" in spec["paths"]
    assert spec["paths"]["/v1/tasks"]["post"]["operationId"] == "tasks-submit_task"
    assert client.get("/docs").status_code == 200
