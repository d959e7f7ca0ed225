"""The API's Prometheus metrics: every request counted by route template and status, and `GET /metrics`.

`GET /metrics` answers the admin token only (Bearer, as every admin route: `AdminDep`), in Prometheus' text
format. Under `loraplane api --workers N` any process answers it with the sum over all N (common/telemetry.py).
It is left out of the OpenAPI document: it is for a scraper, not for API clients.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import AdminDep
from common.telemetry import CONTENT_TYPE, UNMATCHED_ROUTE, api_metrics, render_api_metrics

router = APIRouter(tags=["metrics"])


@router.get("/metrics", dependencies=[AdminDep], include_in_schema=False)
def metrics() -> Response:
    """The API's metrics (every server process's, summed). A plain `def`: it reads files in multiprocess mode."""
    return Response(render_api_metrics(), media_type=CONTENT_TYPE)


def route_label(scope: Scope) -> str:
    """The template of the route that answered (`/v1/tasks/{task_id}`): bounded label values, where raw paths
    (ids) would not be.

    The router leaves the route it matched (fully, or by path only for a 405) in the scope, but a route of an
    included router knows its path without the prefix it was included under (`/tasks/{task_id}` for `/v1`).
    The prefix is the part of the request's path before the route's own pattern matches: found here from the
    route's public `path_regex`, not from FastAPI's private routing state."""
    route = scope.get("route")
    template, pattern = getattr(route, "path", None), getattr(route, "path_regex", None)
    if not isinstance(template, str) or not template or pattern is None:
        return UNMATCHED_ROUTE
    path = str(scope.get("path", ""))
    for i, char in enumerate(path):
        if char == "/" and pattern.match(path[i:]):
            return path[:i] + template
    return template


class RequestMetrics:
    """Pure ASGI (no BaseHTTPMiddleware): a streamed response (SSE, an adapter download) passes through
    untouched. Latency ends when the response's headers are sent, so an hour-long event stream is not an
    hour-long request in the histogram."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        recorded = False

        def record(status: int) -> None:
            nonlocal recorded
            recorded = True
            metrics = api_metrics()
            route, method = route_label(scope), str(scope.get("method", ""))
            metrics.requests.labels(route=route, method=method, status=str(status)).inc()
            metrics.latency.labels(route=route, method=method).observe(time.perf_counter() - start)

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start" and not recorded:
                record(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            # Escapes to the server error middleware above this one, which answers 500. (A cancelled request,
            # the client gone, is a BaseException: not counted, no one got an answer.)
            if not recorded:
                record(500)
            raise


def install(app: FastAPI) -> None:
    app.add_middleware(RequestMetrics)
    app.include_router(router)
