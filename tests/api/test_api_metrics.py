"""`GET /metrics`: the real app's requests counted by route template, method and status, and its latency
histogram by route; only the admin token may read it, refused otherwise in the API's one error shape."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.factories import ADMIN, TenantKey
from tests.prom import Key, matching, samples, value

REQUESTS = "loraplane_api_requests_total"
LATENCY = "loraplane_api_request_duration_seconds"


def scrape(client: TestClient) -> dict[Key, float]:
    r = client.get("/metrics", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


def test_requests_counted_by_route_template_and_status(client: TestClient, tenant: TenantKey) -> None:
    # The registry lives as long as the process (other tests count too): compare before and after.
    before = scrape(client)
    for _ in range(2):
        assert client.get("/healthz").status_code == 200
    missing = ["task-0000000000000000000000aa", "task-0000000000000000000000bb"]
    for task_id in missing:  # two raw paths, one template
        assert client.get(f"/v1/tasks/{task_id}", headers=tenant.headers).status_code == 404
    assert client.get("/v1/tasks").status_code == 401  # no API key
    assert client.post("/healthz").status_code == 405  # the path matched, the method did not
    assert client.get("/no/such/path").status_code == 404
    after = scrape(client)

    def delta(route: str, method: str, status: str) -> float:
        labels = {"route": route, "method": method, "status": status}
        return value(after, REQUESTS, **labels) - value(before, REQUESTS, **labels)

    assert delta("/healthz", "GET", "200") == 2
    assert delta("/v1/tasks/{task_id}", "GET", "404") == 2
    assert delta("/v1/tasks", "GET", "401") == 1
    assert delta("/healthz", "POST", "405") == 1
    assert delta("unmatched", "GET", "404") == 1
    assert delta("/metrics", "GET", "200") == 1  # the first scrape, counted by the time of the second
    # No raw path is ever a label value.
    assert not [k for k in after if any(v in missing for _, v in k[1]) or ("route", "/no/such/path") in k[1]]

    # The latency histogram by route: a count per request, cumulative buckets ending in +Inf.
    count = value(after, f"{LATENCY}_count", route="/v1/tasks/{task_id}", method="GET")
    assert count - value(before, f"{LATENCY}_count", route="/v1/tasks/{task_id}", method="GET") == 2
    buckets = matching(after, f"{LATENCY}_bucket", route="/v1/tasks/{task_id}", method="GET")
    by_le = sorted((float(dict(labels)["le"]), v) for (_, labels), v in buckets.items())
    assert by_le[-1] == (float("inf"), count)
    assert [v for _, v in by_le] == sorted(v for _, v in by_le)
    assert value(after, f"{LATENCY}_sum", route="/v1/tasks/{task_id}", method="GET") > 0


def test_metrics_need_the_admin_token(client: TestClient, tenant: TenantKey) -> None:
    r = client.get("/metrics")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["code"] == "missing_admin_token"
    for headers, status, code in ((tenant.headers, 403, "invalid_admin_token"),
                                  ({"Authorization": "Bearer wrong"}, 403, "invalid_admin_token")):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == status
        assert set(r.json()) == {"error"} and r.json()["error"]["code"] == code
    assert "loraplane_api_requests_total" not in client.get("/metrics").text


def test_metrics_left_out_of_the_openapi_document(client: TestClient) -> None:
    assert "/metrics" not in client.get("/openapi.json").json()["paths"]
