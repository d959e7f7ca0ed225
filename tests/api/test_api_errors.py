"""Every failure answers the one error shape."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.errors import param_from_loc
from tests.factories import TenantKey


def _assert_shape(body: dict) -> dict:
    assert set(body) == {"error"}
    error = body["error"]
    assert {"type", "code", "message", "param"} <= set(error)
    assert isinstance(error["message"], str) and error["message"]
    return error


def test_unknown_route_answers_404_in_the_error_shape(client: TestClient) -> None:
    r = client.get("/v1/nope")
    assert r.status_code == 404
    error = _assert_shape(r.json())
    assert (error["type"], error["code"]) == ("not_found_error", "route_not_found")


def test_wrong_method_answers_405_in_the_error_shape(client: TestClient) -> None:
    r = client.put("/v1/files")
    assert r.status_code == 405
    assert _assert_shape(r.json())["code"] == "method_not_allowed"


def test_query_validation_error_names_the_param(client: TestClient, tenant: TenantKey) -> None:
    r = client.get("/v1/files?limit=0", headers=tenant.headers)
    assert r.status_code == 422
    error = _assert_shape(r.json())
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_value", "limit")
    assert error["errors"][0]["param"] == "limit"


def test_malformed_json_body_is_a_422_without_param(client: TestClient, tenant: TenantKey) -> None:
    r = client.post("/v1/tasks", headers={**tenant.headers, "Content-Type": "application/json"}, content=b"{nope")
    assert r.status_code == 422
    error = _assert_shape(r.json())
    assert error["code"] == "invalid_json"
    assert error["param"] is None


def test_unexpected_exception_is_a_500_without_details(clean_db: None) -> None:
    from api.main import create_app

    app = create_app()

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internal detail")

    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/boom")
    assert r.status_code == 500
    error = _assert_shape(r.json())
    assert (error["type"], error["code"]) == ("api_error", "internal_error")
    assert "secret" not in r.text and "Traceback" not in r.text


def test_param_from_loc_builds_dotted_paths() -> None:
    assert param_from_loc(("body", "search_space", "learning_rate", 1)) == "search_space.learning_rate[1]"
    assert param_from_loc(("body", "search_space", "target_modules", 0, 2)) == "search_space.target_modules[0][2]"
    assert param_from_loc(("query", "limit")) == "limit"
    assert param_from_loc(("body",)) is None


def test_database_outage_is_a_503(clean_db: None) -> None:
    from sqlalchemy.exc import OperationalError

    from api.main import create_app

    app = create_app()

    @app.get("/db-down")
    def db_down() -> None:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/db-down")
    assert r.status_code == 503
    assert _assert_shape(r.json())["code"] == "database_unavailable"
    assert "refused" not in r.text
