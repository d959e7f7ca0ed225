"""Uploads stream: through the real app served by uvicorn, large bodies are validated and stored as they
arrive, with memory bounded far below their size, and limits answer as soon as the bytes pass them."""

from __future__ import annotations

import hashlib
import json
import socket
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from common.artifacts import get_artifact_store
from common.datasets import MAX_LINE_BYTES
from common.tables import File
from tests.e2e.procs import app_in_thread
from tests.factories import TenantKey, count_rows, make_tenant

BOUNDARY = "lp-test-boundary-7c1f"
MiB = 1024 * 1024
# One chat row of about 1 KiB.
ROW = json.dumps({"messages": [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "a" * 560}]})
ROW_LINE = ROW.encode() + b"\n"
ROWS_PER_PIECE = 256  # the client sends about 256 KiB at a time


@pytest.fixture(scope="module")
def server(database: str) -> Iterator[tuple[str, int]]:
    with app_in_thread() as port:
        yield f"http://127.0.0.1:{port}", port


@pytest.fixture
def http(server: tuple[str, int], clean_db: None) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=120) as c:
        yield c


def _tenant(http: httpx.Client, **quota: int) -> TenantKey:
    return make_tenant(http, **quota)  # type: ignore[arg-type]


def _preamble(filename: str = "big.jsonl") -> bytes:
    return (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode()


EPILOGUE = f"\r\n--{BOUNDARY}--\r\n".encode()
FORM_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def _file_lines(rows: int, extra: dict[int, bytes] | None = None) -> Iterator[bytes]:
    """`rows` copies of ROW_LINE in pieces of ROWS_PER_PIECE lines, line number n replaced by extra[n]."""
    extra = extra or {}
    for first in range(1, rows + 1, ROWS_PER_PIECE):
        numbers = range(first, min(first + ROWS_PER_PIECE, rows + 1))
        yield b"".join(extra.get(n, ROW_LINE) for n in numbers)


def _files_in_store() -> set[Path]:
    root = get_artifact_store().root / "files"
    return set(root.iterdir()) if root.exists() else set()


def test_a_large_upload_streams_with_memory_bounded_far_below_its_size(http: httpx.Client) -> None:
    tenant = _tenant(http)
    rows = 24 * 1024  # about 24 MiB
    digest = hashlib.sha256()
    sent = 0

    def body() -> Iterator[bytes]:  # made as it is sent: the client holds one piece at a time
        nonlocal sent
        yield _preamble()
        for piece in _file_lines(rows):
            digest.update(piece)
            sent += len(piece)
            yield piece
        yield EPILOGUE

    tracemalloc.start()
    try:
        r = http.post("/v1/files", content=body(), headers={**tenant.headers, "Content-Type": FORM_TYPE})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status_code == 201, r.text
    file = r.json()
    assert (file["rows"], file["bytes"], file["sha256"]) == (rows, sent, digest.hexdigest())
    assert sent > 24 * MiB
    # Everything this process allocated while the request ran (client and server): a few pieces, a line.
    # Reading the upload whole, as before, took more than the file's size (its bytes, then its text).
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB for a {sent / MiB:.0f} MiB upload"
    stored = get_artifact_store().path(f"files/{file['id']}.jsonl")
    assert stored.stat().st_size == sent


def test_concurrent_large_uploads_each_take_little_memory(http: httpx.Client, server: tuple[str, int]) -> None:
    tenant = _tenant(http)
    uploads, rows = 4, 8 * 1024  # 4 at once, about 8 MiB each

    def body() -> Iterator[bytes]:  # made as it is sent
        yield _preamble()
        yield from _file_lines(rows)
        yield EPILOGUE

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=server[0], timeout=120) as own:
            return own.post("/v1/files", content=body(), headers={**tenant.headers, "Content-Type": FORM_TYPE})

    tracemalloc.start()
    try:
        with ThreadPoolExecutor(uploads) as pool:
            answers = list(pool.map(send, range(uploads)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(r.status_code, r.json()["rows"]) for r in answers] == [(201, rows)] * uploads
    assert peak < 12 * MiB, f"peak {peak / MiB:.1f} MiB for {uploads} uploads of {rows * len(ROW_LINE) / MiB:.0f} MiB"


def test_a_bad_line_deep_in_a_large_file_is_reported_by_its_line(http: httpx.Client) -> None:
    tenant = _tenant(http)
    rows, bad, long = 8 * 1024, 8 * 1024 - 3, 5000
    huge = b'{"prompt": "' + b"x" * MAX_LINE_BYTES + b'", "completion": "y"}\n'
    extra = {bad: b'{"prompt": "p", "completion": \n', long: huge}
    parts = [_preamble(), *_file_lines(rows, extra), EPILOGUE]
    before = _files_in_store()
    r = http.post("/v1/files", content=iter(parts), headers={**tenant.headers, "Content-Type": FORM_TYPE})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["error_count"]) == ("invalid_file", "file", 2)
    assert [e["line"] for e in error["errors"]] == [long, bad]
    assert f"longer than {MAX_LINE_BYTES} bytes" in error["errors"][0]["message"]
    assert "invalid JSON" in error["errors"][1]["message"]
    assert _files_in_store() == before and count_rows(File) == 0


def _raw_request(port: int, head: str, body_pieces: list[bytes]) -> str:
    """Sends a request's head and then the given pieces of body (possibly not all of it), and reads what
    the server answers meanwhile: its status line and its JSON error."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode())
        for piece in body_pieces:
            sock.sendall(piece)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer.decode(errors="replace")


def _chunked(piece: bytes) -> bytes:
    return f"{len(piece):x}\r\n".encode() + piece + b"\r\n"


def test_past_the_size_limit_the_answer_is_413_before_the_body_ends_and_nothing_is_stored(
    http: httpx.Client, server: tuple[str, int]
) -> None:
    tenant = _tenant(http, max_file_bytes=2 * MiB)
    before = _files_in_store()
    head = (f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tenant.key}\r\n"
            f"Content-Type: {FORM_TYPE}\r\nTransfer-Encoding: chunked\r\n\r\n")
    # 3 MiB of an endless body: the server must answer without waiting for the rest, which never comes.
    answer = _raw_request(server[1], head, [_chunked(_preamble()), *map(_chunked, _file_lines(3 * 1024))])
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    error = json.loads(answer.split("\r\n\r\n", 1)[1])["error"]
    assert (error["code"], error["param"], error["limit"]) == ("file_too_large", "file", 2 * MiB)
    assert _files_in_store() == before and count_rows(File) == 0


def test_a_declared_length_past_the_limit_and_a_missing_key_answer_before_any_body_is_sent(
    http: httpx.Client, server: tuple[str, int]
) -> None:
    tenant = _tenant(http, max_file_bytes=MiB)
    head = f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: {FORM_TYPE}\r\nContent-Length: {50 * MiB}\r\n"
    answer = _raw_request(server[1], head + f"Authorization: Bearer {tenant.key}\r\n\r\n", [])
    assert answer.startswith("HTTP/1.1 413") and '"file_too_large"' in answer, answer[:300]
    answer = _raw_request(server[1], head + "\r\n", [])  # no key: refused before the body, not after it
    assert answer.startswith("HTTP/1.1 401") and '"missing_api_key"' in answer, answer[:300]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (_preamble() + ROW_LINE, "invalid_multipart", None),  # cut off before its closing boundary
        (_preamble() + ROW_LINE + f"\r\n--{BOUNDARY}\r\n".encode() + _preamble()[len(BOUNDARY) + 4:] + ROW_LINE
         + EPILOGUE, "invalid_value", "file"),  # two files
        (f'--{BOUNDARY}\r\nContent-Disposition: form-data\r\n\r\nx'.encode() + EPILOGUE, "invalid_multipart", None),
    ],
    ids=["truncated", "two-files", "part-without-name"],
)
def test_malformed_forms_are_422(http: httpx.Client, body: bytes, code: str, param: str | None) -> None:
    tenant = _tenant(http)
    before = _files_in_store()
    r = http.post("/v1/files", content=body, headers={**tenant.headers, "Content-Type": FORM_TYPE})
    assert r.status_code == 422, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)
    assert _files_in_store() == before and count_rows(File) == 0


@pytest.mark.parametrize(
    ("content_type", "code"),
    [("application/json", "missing_field"), ("multipart/form-data", "missing_field"),
     ("multipart/form-data; boundary=" + "b" * 200, "invalid_multipart")],  # past the longest boundary allowed
    ids=["json", "no-boundary", "boundary-too-long"],
)
def test_a_body_that_is_no_multipart_form_is_422(http: httpx.Client, content_type: str, code: str) -> None:
    tenant = _tenant(http)
    r = http.post("/v1/files", content=b'{"file": "x"}', headers={**tenant.headers, "Content-Type": content_type})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, "file" if code == "missing_field" else None)
