"""A multipart/form-data request body read as it arrives, for uploads.

Starlette's form parsing (behind FastAPI's `UploadFile`) receives the whole body, spooling files to a
temporary file, before a route or even its authentication runs. Here the route authenticates first and then
pulls the body piece by piece: each piece of a part is handed on as it arrives, so a limit is enforced as
soon as the bytes pass it and nothing but the piece in hand is in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio.from_thread
from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.requests import ClientDisconnect, Request

from api.errors import INVALID_REQUEST, ApiError, invalid


@dataclass(frozen=True)
class PartStart:
    name: str
    filename: str | None  # None: a plain field, not a file


# A part's start, then its content in pieces (bytes); a part ends where the next one starts.
FormEvent = PartStart | bytes


def _decode(value: bytes) -> str:
    return value.decode("utf-8", errors="replace")


def multipart_boundary(content_type: str | None) -> bytes | None:
    """The boundary of a multipart/form-data body; None for a body of any other type."""
    media_type, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    return boundary if media_type == b"multipart/form-data" and boundary else None


def form_events(boundary: bytes, body: Iterable[bytes]) -> Iterator[FormEvent]:
    """The parts of a multipart/form-data body, streamed. Malformed input raises a 422 (`invalid_multipart`)."""
    events: list[FormEvent] = []
    disposition = b""
    header_name = b""
    header_value = b""
    ended = False

    def on_header_field(data: bytes, start: int, end: int) -> None:
        nonlocal header_name
        header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        nonlocal header_value
        header_value += data[start:end]

    def on_header_end() -> None:
        nonlocal disposition, header_name, header_value
        if header_name.lower() == b"content-disposition":
            disposition = header_value
        header_name = header_value = b""

    def on_headers_finished() -> None:
        nonlocal disposition
        _, options = parse_options_header(disposition)
        disposition = b""
        if b"name" not in options:
            raise invalid("A form part has no name in its Content-Disposition header.", code="invalid_multipart")
        filename = options.get(b"filename")
        events.append(PartStart(_decode(options[b"name"]), None if filename is None else _decode(filename)))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        events.append(data[start:end])

    def on_end() -> None:
        nonlocal ended
        ended = True

    def malformed(exc: FormParserError) -> ApiError:
        return invalid(f"The multipart body is malformed: {exc}", code="invalid_multipart")

    try:  # python-multipart bounds the boundary, and each part's headers (8 of 4 KiB at most)
        parser = MultipartParser(boundary, {
            "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_end": on_end,
        })
    except FormParserError as exc:
        raise malformed(exc) from exc
    for chunk in body:
        try:
            parser.write(chunk)
        except FormParserError as exc:
            raise malformed(exc) from exc
        pending, events = events, []
        yield from pending
    if not ended:
        raise invalid("The multipart body ended before its closing boundary.", code="invalid_multipart")


async def _next_piece(stream: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


@contextmanager
def request_body(request: Request) -> Iterator[Iterator[bytes]]:
    """The request's body as it arrives, for a sync route (which FastAPI runs in a worker thread): each
    read waits on the event loop for the next piece the server received. Leaving the block closes the
    stream on the event loop, however far it was read."""
    stream = request.stream()

    def pieces() -> Iterator[bytes]:
        try:
            while (piece := anyio.from_thread.run(_next_piece, stream)) is not None:
                if piece:
                    yield piece
        except ClientDisconnect as exc:  # nobody reads this answer; it keeps a traceback out of the log
            raise ApiError(400, INVALID_REQUEST, "client_disconnected",
                           "The client left before its request body ended.") from exc

    try:
        yield pieces()
    finally:
        anyio.from_thread.run(stream.aclose)
