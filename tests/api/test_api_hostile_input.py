"""Hostile input cannot take the service down (issue 29): each case below, sent to a real `loraplane api` process
in the embedded mode (SQLite under LORAPLANE_HOME) and in the distributed mode (PostgreSQL and Redis), answers
in the one error shape and never 5xx, quickly; the process's peak memory stays bounded; nothing is written.

The API runs under an address-space cap (`prlimit --as`), as the issues' distributed API did: without the regex
policy `a{1000000000}` made `regex.compile` grow to 17 GB and kill `loraplane up` (issue 29), and a verbose-mode
`(?x)a{1 000 000 000}` slipped past a judge that parsed with another engine (issue 52); under the cap the same
request fails inside the process (a MemoryError, a 500), so a regression fails this test instead of the machine.
Memory is measured from /proc: the process's peak resident set (VmHWM) before and after each case.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, inspect, text

from tests.conftest import SERVER_URL
from tests.e2e.procs import Cluster, cluster, distributed_env, free_port, wait_ready
from tests.factories import ADMIN, ADMIN_TOKEN, chat_rows

EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ARTIFACT_DIR", "LORAPLANE_NAMESPACE")
# The API's address space: its own use (~1.5 GB of mostly unbacked virtual memory: thread stacks, allocator
# arenas, the libraries) with room to spare, far below what an unbounded compile asks for.
ADDRESS_SPACE_CAP = 4 << 30
# Peak RSS growth allowed over all the cases: parsing a 1 MiB body or validating the deep upload costs a few MB;
# the compile the policy prevents costs ~270 bytes per repeated item (a{1000000000}: hundreds of GB).
MAX_PEAK_GROWTH_MB = 96
MAX_SECONDS = 10.0  # each answer; measured in milliseconds, the rest is room for a loaded 2-core machine


@dataclass
class Api:
    mode: str
    client: httpx.Client
    headers: dict[str, str]
    pid: int
    database_url: str
    artifact_dir: Path
    file_id: str

    def peak_rss_mb(self) -> float:
        """The process's peak resident set so far (VmHWM), in MB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError(f"no VmHWM for pid {self.pid}")

    def stored_files(self) -> list[str]:
        """Every object in the artifact store (an upload refused must leave none behind, staged or not)."""
        return sorted(str(p.relative_to(self.artifact_dir)) for p in self.artifact_dir.rglob("*") if p.is_file())

    def row_counts(self) -> dict[str, int]:
        """Every table's row count (what "nothing written" is checked against)."""
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                tables = [t for t in inspect(conn).get_table_names() if t != "alembic_version"]
                return {t: int(conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one()) for t in tables}
        finally:
            engine.dispose()


def _capped(argv: list[str]) -> list[str]:
    return ["prlimit", f"--as={ADDRESS_SPACE_CAP}", "--", *argv]


def _start_api(c: Cluster) -> tuple[str, int]:
    """`loraplane api` under the address-space cap; its URL once ready, and its pid."""
    port = free_port()
    proc = c.run("api", _capped([sys.executable, "-m", "loraplane.cli", "api", "--host", "127.0.0.1",
                                 "--port", str(port)]))
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, [proc])
    return base_url, proc.proc.pid  # prlimit execs the command: the same pid


@pytest.fixture(scope="module", params=["embedded", "distributed"])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"hostile-{mode}")
    admin_engine = create_engine(SERVER_URL, isolation_level="AUTOCOMMIT")
    db_name = f"loraplane_hostile_{uuid.uuid4().hex[:8]}"
    if mode == "embedded":
        env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
        env.update({"LORAPLANE_HOME": str(tmp / "home"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN})
        database_url = f"sqlite:///{tmp / 'home' / 'loraplane.db'}"
    else:
        with admin_engine.connect() as conn:  # a database of its own: the counts are this API's alone
            conn.execute(text(f'CREATE DATABASE "{db_name}"'))
        database_url = f"{SERVER_URL.rpartition('/')[0]}/{db_name}"
        env = {**distributed_env(tmp), "DATABASE_URL": database_url}
    try:
        with cluster(env, tmp) as c:
            base_url, pid = _start_api(c)
            with httpx.Client(base_url=base_url, timeout=60) as client:
                tenant_id = client.post("/v1/admin/tenants", headers=ADMIN, json={"name": "hostile"}).json()["id"]
                key = client.post(f"/v1/admin/tenants/{tenant_id}/api-keys", headers=ADMIN).json()["key"]
                headers = {"Authorization": f"Bearer {key}"}
                r = client.post("/v1/files", headers=headers, files={"file": ("t.jsonl", chat_rows())})
                assert r.status_code == 201, r.text
                artifacts = Path(env.get("LORAPLANE_ARTIFACT_DIR") or Path(env["LORAPLANE_HOME"]) / "artifacts")
                yield Api(mode, client, headers, pid, database_url, artifacts, r.json()["id"])
    finally:
        if mode == "distributed":
            with admin_engine.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
        admin_engine.dispose()


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    status: int
    code: str
    param: str | None
    json_body: Any = None
    content: bytes | None = None
    upload: bytes | None = None
    chunked_mb: int = 0  # a body of this many MiB sent chunked (no Content-Length), made as it is sent
    message: str = ""  # a fragment the message (or the upload's line entry) must contain


def _task(file_id: str, pattern: str) -> dict[str, Any]:
    return {"base_model": "tiny-random-llama", "training_file": file_id, "max_steps": 2,
            "search_space": {"learning_rate": [0.001]}, "evaluation": {"metric": "regex", "pattern": pattern}}


# (name, pattern, the limit's message fragment, the code): each sent as a dry run and as a real submission.
PATTERNS = [
    ("repeat-1e9", "a{1000000000}", "repetition count 1000000000 is over the limit of 1000", "regex_too_complex"),
    ("nested-60000", "(?:a{60000}){60000}", "a repeat's count may be at most 1000", "regex_too_complex"),
    ("nested-product", "(a{1000}){1000}", "nested repeats' counts multiplied together", "regex_too_complex"),
    ("nested-small-counts", "(?:(?:a{30}){30}){30}", "nested repeats' counts multiplied together",
     "regex_too_complex"),
    ("program-over-budget", "(?i)(?:\\pL|\\pN){1000}", "the compiled pattern needs more than 8 MiB",
     "regex_too_complex"),
    # Issue 52's table: verbose mode, whose spaced counts the old judge (Python's re) read as literal text while
    # the old compiler (the regex package) expanded them; RE2 refuses verbose mode.
    ("verbose-1e9", "(?x)a{1 000 000 000}", "verbose mode (?x) is not supported", "invalid_regex"),
    ("verbose-1e8", "(?x)a{ 100000000 }", "verbose mode (?x) is not supported", "invalid_regex"),
    ("verbose-nested", "(?x)(?:a{1 000}){1 000}", "verbose mode (?x) is not supported", "invalid_regex"),
    ("verbose-scoped", "(?x: a{1 000 000})", "verbose mode (?x) is not supported", "invalid_regex"),
    ("verbose-comment", "(?ix)a{1000 000}  # a comment", "verbose mode (?x) is not supported", "invalid_regex"),
    ("possessive", "a{100000}+", "a repeat's count may be at most 1000", "regex_too_complex"),
    ("atomic", "(?>a{1000})", "atomic groups are not supported", "invalid_regex"),
    ("lower-bound", "a{100000,}", "a repeat's count may be at most 1000", "regex_too_complex"),
    # Thousands deep is past the schema's 500 characters: refused by the length before the policy runs.
    ("nesting-5000", "(" * 5000 + ")" * 5000, "at most 500 characters", "invalid_value"),
]
DEEP = "[" * 100_000 + "]" * 100_000


def _cases(file_id: str) -> list[Case]:
    cases = []
    for name, pattern, message, code in PATTERNS:
        for suffix in ("?dry_run=true", ""):
            cases.append(Case(f"regex-{name}{suffix and '-dry-run'}", "POST", f"/v1/tasks{suffix}", 422, code,
                              "evaluation.pattern", json_body=_task(file_id, pattern), message=message))
    deep_row = b'{"prompt": "p", "completion": "c"}\n' + ("[" * 50_000 + "]" * 50_000).encode() + b"\n"
    cases.append(Case("jsonl-row-50000-deep", "POST", "/v1/files", 422, "invalid_file", "file", upload=deep_row,
                      message="line 2: row nests arrays and objects deeper than 64 levels"))
    # JSON bodies nested 100,000 deep (200 kB, under the body limit): json.loads's RecursionError, which FastAPI
    # answers as a body it could not parse (a 400, as tests/api/test_api_input_validation.py pins it).
    for method, path in (("POST", "/v1/tasks"), ("POST", "/v1/tasks?dry_run=true"), ("POST", "/v1/webhooks"),
                         ("POST", "/v1/search-spaces/expand"), ("POST", "/v1/admin/tenants")):
        for name, content in (("body", DEEP), ("field", '{"search_space": ' + DEEP + "}")):
            cases.append(Case(f"{name}-100000-deep {method} {path}", method, path, 400, "http_error", None,
                              content=content.encode(), message="error parsing the body"))
    # Webhooks aimed inward, as address literals (no name is resolved: no DNS query leaves the machine, and
    # registration connects nowhere): 422 url_not_allowed, the resolved address never echoed.
    for url in ("http://127.0.0.1:8000/hook", "http://[::1]/hook", "http://10.0.0.1/hook",
                "http://169.254.169.254/latest/meta-data/", "http://[::ffff:127.0.0.1]/hook"):
        cases.append(Case(f"webhook-inward {url}", "POST", "/v1/webhooks", 422, "url_not_allowed", "url",
                          json_body={"url": url}, message="webhooks are sent to public addresses only"))
    # Webhooks whose host URL parsers read differently (issue 52: `\` or `%2f` before the `@`), refused before any
    # name is resolved: 422 invalid_url, saying how to write it.
    for url in ("https://evil.example\\@example.com/hook", "https://evil.example%2f@example.com/hook",
                "https://evil.example%2F@example.com/hook"):
        cases.append(Case(f"webhook-ambiguous {url}", "POST", "/v1/webhooks", 422, "invalid_url", "url",
                          json_body={"url": url}, message="write the host plainly"))
    # Bodies past LORAPLANE_MAX_REQUEST_BYTES (1 MiB): declared (refused before a byte is read) and chunked (cut
    # off as it passes the bound); FastAPI would otherwise read either whole into memory (api/limits.py).
    too_large = "larger than the limit of 1048576 bytes"
    cases.append(Case("body-64MiB-declared", "POST", "/v1/tasks", 413, "request_too_large", None,
                      content=b" " * (64 << 20), message=too_large))
    cases.append(Case("body-256MiB-chunked", "POST", "/v1/tasks", 413, "request_too_large", None,
                      chunked_mb=256, message=too_large))
    return cases


def _chunks(mib: int) -> Iterator[bytes]:
    piece = b" " * (1 << 20)
    for _ in range(mib):
        yield piece


def _send(api: Api, case: Case) -> httpx.Response:
    headers = ADMIN if case.path.startswith("/v1/admin/") else api.headers
    if case.upload is not None:
        return api.client.post(case.path, headers=headers, files={"file": ("hostile.jsonl", case.upload)})
    if case.chunked_mb:
        return api.client.request(case.method, case.path, content=_chunks(case.chunked_mb),
                                  headers={**headers, "Content-Type": "application/json"})
    if case.content is not None:
        return api.client.request(case.method, case.path, content=case.content,
                                  headers={**headers, "Content-Type": "application/json"})
    return api.client.request(case.method, case.path, json=case.json_body, headers=headers)


def test_hostile_input_answers_in_the_one_shape_with_bounded_memory_and_writes_nothing(api: Api) -> None:
    rows_before, files_before, peak_before = api.row_counts(), api.stored_files(), api.peak_rss_mb()
    assert rows_before["tasks"] == 0 and rows_before["files"] == 1 and len(files_before) == 1
    report = []
    for case in _cases(api.file_id):
        started = time.monotonic()
        r = _send(api, case)
        seconds = time.monotonic() - started
        peak = api.peak_rss_mb()
        report.append(f"{api.mode} {case.name}: {r.status_code} in {seconds * 1000:.0f} ms, peak RSS {peak:.0f} MB")
        assert r.status_code < 500, (case.name, r.status_code, r.text[:300])
        body = r.json()
        assert set(body) == {"error"} and {"type", "code", "message", "param"} <= set(body["error"]), body
        error = body["error"]
        assert (r.status_code, error["code"], error["param"]) == (case.status, case.code, case.param), \
            (case.name, r.text[:300])
        assert case.message in error["message"], (case.name, error["message"][:300])
        if case.upload is not None:  # the line's own entry in the upload's list of row errors
            assert error["errors"] == [{"line": 2, "message": case.message.removeprefix("line 2: ")}], error
        assert seconds < MAX_SECONDS, report[-1]
        assert peak - peak_before < MAX_PEAK_GROWTH_MB, report
    print("\n".join(report))  # the measured numbers, shown with -s
    assert api.row_counts() == rows_before
    assert api.stored_files() == files_before
    assert api.client.get("/readyz").status_code == 200  # still serving
    tasks = api.client.get("/v1/tasks", headers=api.headers).json()["data"]
    assert tasks == []
