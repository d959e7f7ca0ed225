"""A bound on every request body the API reads whole.

FastAPI reads a JSON body into memory before validating it, so without a bound one client could make an API
process hold (and parse) gigabytes. Every request body is limited to `LORAPLANE_MAX_REQUEST_BYTES` (1 MiB by
default: the largest task body, a search space with every list at its bound, is a few kilobytes) except the
dataset upload, `POST /v1/files`, which streams its body to the artifact store and has its own limits
(`max_file_bytes`, the storage quota: api/uploads.py).

A declared `Content-Length` over the bound is refused before a byte is read; a chunked body is counted as it
arrives and refused the moment it passes the bound. Either way the answer is 413 in the one error shape and the
route never runs, so nothing is written.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import INVALID_REQUEST, ApiError, error_response

# Paths whose bodies are streamed and bounded by their own route, keyed by method.
STREAMED_BODIES = {("POST", "/v1/files")}


class BodyTooLarge(Exception):
    pass


def too_large(limit: int) -> ApiError:
    return ApiError(413, INVALID_REQUEST, "request_too_large",
                    f"The request body is larger than the limit of {limit} bytes.", limit=limit)


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class RequestBodyLimit:
    """Pure ASGI (a streamed response, SSE or a download, passes through untouched).

    Written here rather than FastAPI's own `max_body_size`: that one arrived only in recent FastAPI releases, and
    its 413 is rendered by FastAPI's default handler, not in the API's one error shape. FastAPI turns any error
    raised while it reads a body into a 400, so the 413 is sent from inside `receive` the moment the body passes
    the bound, and whatever the route answers after that is dropped."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in STREAMED_BODIES:
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            await error_response(too_large(self.max_bytes))(scope, receive, send)
            return
        received, started, refused = 0, False, False

        async def counted_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if not started and not refused:
                        refused = True
                        await error_response(too_large(self.max_bytes))(scope, receive, send)
                    raise BodyTooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out: the route's own answer to the broken-off body is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if not refused:  # a route that answered before reading its whole body: nothing more can be said
                raise
