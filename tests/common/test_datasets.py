"""JSONL validation as it streams: the same report however the file is cut, bounded lines, and the worker's
parser agreeing with the validator's row count."""

from __future__ import annotations

import json

import pytest

from common.datasets import MAX_LINE_BYTES, MAX_REPORTED_ERRORS, JsonlValidator, parse_jsonl, validate_jsonl

GOOD = json.dumps({"prompt": "p", "completion": "c"}).encode()
# A raw U+2028 inside a string is valid JSON (str.splitlines would cut the row in two there).
SEPARATOR_IN_TEXT = json.dumps({"prompt": "a\u2028b", "completion": "c"}, ensure_ascii=False).encode()
FILE = b"\n".join([GOOD, b"oops", GOOD + b"\r", b"", b"  ", b"{}", "caf\u00e9".encode("latin-1"),
                   SEPARATOR_IN_TEXT, GOOD])


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, len(FILE)])
def test_the_report_is_the_same_however_the_file_is_cut(piece: int) -> None:
    validator = JsonlValidator()
    for start in range(0, len(FILE), piece):
        validator.feed(FILE[start:start + piece])
    report = validator.finish()
    assert (report.rows, report.format, report.error_count) == (4, "prompt_completion", 3)
    assert [(e.line, e.message.split(":")[0]) for e in report.errors] == [
        (2, "invalid JSON"), (6, "row needs either 'messages' or 'prompt' and 'completion'"),
        (7, "line is not UTF-8")]
    assert report == validate_jsonl(FILE)


def test_the_worker_parses_the_rows_the_validator_counted() -> None:
    data = b"\r\n".join([GOOD, SEPARATOR_IN_TEXT, b"", GOOD]) + b"\r\n"
    report = validate_jsonl(data)
    rows = parse_jsonl(data)
    assert report.ok and report.rows == len(rows) == 3
    assert rows[1]["prompt"] == "a\u2028b"


def test_a_line_past_the_limit_is_one_error_and_is_never_held_whole() -> None:
    validator = JsonlValidator()
    validator.feed(GOOD + b"\n" + b'{"prompt": "')
    for _ in range(4):  # 4 MiB of one line, in 1 MiB pieces
        validator.feed(b"x" * MAX_LINE_BYTES)
        assert len(validator._line) <= MAX_LINE_BYTES
    validator.feed(b'", "completion": "c"}\n' + GOOD)
    report = validator.finish()
    assert (report.rows, report.error_count) == (2, 1)
    assert (report.errors[0].line, report.errors[0].message) == (2, f"line is longer than {MAX_LINE_BYTES} bytes")
    at_limit = b'{"prompt": "' + b"x" * (MAX_LINE_BYTES - 33) + b'", "completion": "c"}'
    assert len(at_limit) == MAX_LINE_BYTES and validate_jsonl(at_limit + b"\n").ok
    assert validate_jsonl(b" " + at_limit).errors[0].message == f"line is longer than {MAX_LINE_BYTES} bytes"


def test_every_error_is_counted_and_the_first_ones_are_kept() -> None:
    report = validate_jsonl(b"\n".join([b"bad"] * 50 + [GOOD]))
    assert (report.error_count, len(report.errors), report.rows) == (50, MAX_REPORTED_ERRORS, 1)
    assert [e.line for e in report.errors] == list(range(1, MAX_REPORTED_ERRORS + 1))
