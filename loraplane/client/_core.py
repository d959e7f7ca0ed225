"""What the sync and the async client share: headers, response checks, the SSE decoder, uploads and
adapter archives, and the few sync/async pairs `_unasync.py` swaps. No I/O on the network here."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any, BinaryIO

import anyio
import httpx

from loraplane.client.errors import APIConnectionError, APIError, ConfigurationError
from loraplane.client.objects import Event

USER_AGENT = "loraplane-client/0.1.0"
STREAM_READ_TIMEOUT_S = 60.0  # the server sends a keep-alive every 15 s; silence this long means the stream is dead
EVENTS_PAGE = 1000  # events per request when polling (the API's maximum)

FileInput = str | os.PathLike[str] | bytes | BinaryIO
JsonLines = list[dict[str, Any]]


def params(**values: Any) -> dict[str, Any]:
    """Query or body values, without those left out (None)."""
    return {k: v for k, v in values.items() if v is not None}


def iso(when: datetime | str | None) -> str | None:
    """A time for a query: a datetime as ISO 8601 (no zone: UTC), a string as given."""
    return when.isoformat() if isinstance(when, datetime) else when


def bearer(token: str | None, what: str, hint: str) -> dict[str, str]:
    if not token:
        raise ConfigurationError(f"no {what}: {hint}")
    return {"Authorization": f"Bearer {token}"}


KEY_HINT = "pass api_key=..., set LORAPLANE_API_KEY, or run `loraplane login`"
ADMIN_HINT = "pass admin_token=... or set LORAPLANE_ADMIN_TOKEN"


def connection_error(exc: httpx.TransportError, base_url: str) -> APIConnectionError:
    kind = "timed out talking to" if isinstance(exc, httpx.TimeoutException) else "cannot reach"
    detail = str(exc) or type(exc).__name__
    return APIConnectionError(f"{kind} the API at {base_url}: {detail}", url=base_url)


def json_body(response: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object (already checked for errors)."""
    body = response.json()
    if not isinstance(body, dict):
        raise APIError(response.status_code, {"error": {
            "type": "api_error", "code": "unexpected_body", "message": "The API answered something other than an "
            "object.", "param": None}})
    return body


def upload_part(file: FileInput, filename: str | None) -> tuple[str, Any, str]:
    """(filename, content, content type) for the multipart `file` field. A str or a path is a local path."""
    if isinstance(file, str | os.PathLike):
        path = Path(file)
        return filename or path.name, path.read_bytes(), "application/jsonl"
    if isinstance(file, bytes):
        return filename or "data.jsonl", file, "application/jsonl"
    name = filename or Path(str(getattr(file, "name", "data.jsonl"))).name
    return name, file.read(), "application/jsonl"


@dataclass
class SSEDecoder:
    """Server-Sent Events, line by line (the lines without their ending). A blank line ends a message."""

    event: str = ""
    data: list[str] = field(default_factory=list)
    last_id: str | None = None

    def feed(self, line: str) -> tuple[str, str] | None:
        """(event name, data) when `line` completes a message; comments and keep-alives give nothing."""
        if not line:
            if not self.data and not self.event:
                return None
            message = (self.event or "message", "\n".join(self.data))
            self.event, self.data = "", []
            return message
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        elif name == "id":
            self.last_id = value
        return None


class StreamEnded(Exception):
    """The SSE stream's `end` message: the task is final and every event was sent."""

    def __init__(self, state: str | None) -> None:
        super().__init__(state)
        self.state = state


class StreamBroken(Exception):
    """The stream is not usable (not SSE, a server error, closed early): fall back to polling."""


def sse_event(name: str, data: str) -> Event:
    """An SSE message as an Event; raises StreamEnded on the final `end` message, and APIError (401) on a final
    `error` message (the key was revoked, or its tenant deleted, while the stream was open)."""
    payload = json.loads(data) if data else {}
    if name == "end":
        raise StreamEnded(payload.get("state"))
    if name == "error":
        raise APIError(401, payload)
    return Event.of(payload)


def check_stream(response: httpx.Response) -> None:
    """Before reading an opened event stream (its body unread): an error answer, or not SSE at all."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        raise StreamBroken(f"the event stream answered {response.headers.get('content-type')!r}, not SSE")


def completion_piece(line: str) -> str | None:
    """The text of one line of a completion's event stream (OpenAI's chunks), None for the rest; an error object
    sent after the stream began raises it as an APIError (its status: 401 when the key was revoked or its tenant
    deleted mid-answer, else 503, the sampler failed mid-answer)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    chunk = json.loads(line[len("data: "):])
    if "error" in chunk:
        raise APIError(401 if chunk["error"].get("type") == "authentication_error" else 503, chunk)
    choice = chunk["choices"][0]
    return str(choice["delta"].get("content", "")) if "delta" in choice else str(choice.get("text", ""))


def stream_timeout(timeout: httpx.Timeout, deadline_left: float | None) -> httpx.Timeout:
    read = STREAM_READ_TIMEOUT_S if deadline_left is None else max(0.1, min(STREAM_READ_TIMEOUT_S, deadline_left))
    return httpx.Timeout(timeout.connect, read=read, write=timeout.write, pool=timeout.pool)


FILENAME = re.compile(r'filename="?([^";]+)"?')


log = logging.getLogger("loraplane.client")


def resent_notice(response: httpx.Response, last: str | None) -> str | None:
    """What an export's 202 says when its build was sent again (the worker building it was lost), logged as a warning
    the first time it is seen (``last``: the notice seen before); returns the notice, None when the 202 says none."""
    try:
        body = response.json()
    except ValueError:
        return last
    if not isinstance(body, dict) or not body.get("resent"):
        return None
    notice = str(body.get("message") or f"the build was sent again ({body['resent']})")
    if notice != last:
        log.warning("%s", notice)
    return notice


def retry_after(response: httpx.Response, default_s: float = 5.0) -> float:
    """The seconds a 202 asks the client to wait before asking again (`Retry-After`, within 1-60 s)."""
    try:
        return min(60.0, max(1.0, float(response.headers.get("retry-after", default_s))))
    except ValueError:
        return default_s


def archive_dir(response: httpx.Response, directory: str | os.PathLike[str] | None) -> Path:
    """Where an adapter goes: `directory`, else `./<task>-<trial>-adapter` from the answer's file name."""
    if directory is not None:
        return Path(directory)
    match = FILENAME.search(response.headers.get("content-disposition", ""))
    name = Path(match.group(1)).name if match else "adapter.tar.gz"
    return Path(name.removesuffix(".tar.gz").removesuffix(".tgz").removesuffix(".tar") or "adapter")


def download_target(response: httpx.Response, path: str | os.PathLike[str] | None, default: str) -> Path:
    """Where a downloaded file goes: `path`, else the answer's file name (its last part only) in `.`."""
    if path is not None:
        return Path(path)
    match = FILENAME.search(response.headers.get("content-disposition", ""))
    return Path(Path(match.group(1)).name if match else default)


def extract_archive(archive: IO[bytes], directory: Path) -> Path:
    """Unpacks a downloaded .tar.gz into `directory` (created), refusing members that would land outside it."""
    archive.seek(0)
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=archive, mode="r:*") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            tar.extractall(directory, filter="data")
        else:  # pragma: no cover - older 3.11 patch releases
            root = directory.resolve()
            for member in tar.getmembers():
                target = (root / member.name).resolve()
                if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
                    raise ValueError(f"refusing archive member {member.name!r}")
            tar.extractall(directory)  # noqa: S202 - every member checked above
    return directory


# What the two clients do differently, as pairs: `_async.py` calls the `a...` one, and `_unasync.py` writes the
# other into `_sync.py` (`_core.asleep` becomes `time.sleep`).


async def asleep(seconds: float) -> None:
    await anyio.sleep(seconds)


def notify(callback: Callable[[Event], object], event: Event) -> None:
    """Gives `on_event` the event."""
    callback(event)


async def anotify(callback: Callable[[Event], object], event: Event) -> None:
    """Gives `on_event` the event, awaiting what it returns when that is awaitable (a coroutine function)."""
    if inspect.isawaitable(result := callback(event)):
        await result


async def aextract_archive(archive: IO[bytes], directory: Path) -> Path:
    """`extract_archive` in a worker thread, off the event loop."""
    return await anyio.to_thread.run_sync(extract_archive, archive, directory)
