"""JSONL validation as it streams: the same report however the file is cut, bounded lines, the worker's parser
agreeing with the validator's row count, and preference rows (issue 36) in their two forms, each problem line named."""

from __future__ import annotations

import json
import time

import pytest

from common.datasets import (
    DEFAULT_VALIDATION_ROWS,
    MAX_DEFAULT_VALIDATION_SPLIT,
    MAX_LINE_BYTES,
    MAX_REPORTED_ERRORS,
    MAX_ROW_DEPTH,
    JsonlValidator,
    RowTooDeep,
    default_validation_split,
    json_deeper_than,
    parse_jsonl,
    validate_jsonl,
    validation_rows,
)

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


def _nested(depth: int) -> str:
    """A row (a prompt/completion object) whose "meta" nests arrays to `depth` levels in all (at least 2)."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return '{"prompt": "p", "completion": "c", "meta": ' + inner + "}"


TOO_DEEP = f"row nests arrays and objects deeper than {MAX_ROW_DEPTH} levels"


def test_a_row_nested_past_the_limit_is_its_lines_error_and_never_reaches_json_loads() -> None:
    # The row: ~50,000 deep made json.loads raise RecursionError (a 500).
    data = b"\n".join([GOOD, ("[" * 50_000 + "]" * 50_000).encode(), _nested(MAX_ROW_DEPTH + 1).encode(),
                       _nested(MAX_ROW_DEPTH).encode(), GOOD])
    started = time.perf_counter()
    report = validate_jsonl(data)
    assert time.perf_counter() - started < 1.0
    assert (report.rows, report.error_count) == (3, 2)
    assert [(e.line, e.message) for e in report.errors] == [(2, TOO_DEEP), (3, TOO_DEEP)]
    with pytest.raises(RowTooDeep):  # the worker's parser refuses it the same way
        parse_jsonl(data)


@pytest.mark.parametrize("text", [
    "[" * 500_000 + "]" * 500_000,  # a line of 1 MiB, all of it one nest
    '{"a": ' * 65 + "1" + "}" * 65,
    '[[[{"a": ' + "[" * 70,  # an unfinished document: json.loads would recurse this far before failing
])
def test_deeper_than_the_limit(text: str) -> None:
    assert json_deeper_than(text, MAX_ROW_DEPTH)


@pytest.mark.parametrize("text", [
    json.dumps({"prompt": "[" * 10_000 + "{" * 10_000, "completion": "c"}),  # brackets in strings are text
    json.dumps({"prompt": "\"[[[[" * 1000, "completion": "]]]]\\" * 1000}),  # and so are escaped quotes
    "[" + ",".join(["[]"] * 100_000) + "]",  # many arrays, two deep
    '{"a": "' + "[" * 1000,  # a string that never ends: json.loads fails at it, one level deep
    "]" * 100 + "[" * 10,  # not JSON from its first character
    "[[]]" + "[" * 100,  # json.loads reads one value and fails at what follows ("Extra data")
])
def test_not_deeper_than_the_limit(text: str) -> None:
    assert not json_deeper_than(text, MAX_ROW_DEPTH)


def _depth(value: object) -> int:
    """How deep parsed JSON nests (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@pytest.mark.parametrize("depth", [2, 3, 63, 64, 65, 66, 300])
def test_the_scan_counts_the_levels_json_loads_builds(depth: int) -> None:
    text = _nested(depth)
    assert _depth(json.loads(text)) == depth
    assert json_deeper_than(text, MAX_ROW_DEPTH) is (depth > MAX_ROW_DEPTH)


@pytest.mark.parametrize(("rows", "split", "held_out"), [
    (40, 0.25, 10),  # a tenth would be 4 rows: a quarter, the most the rule takes
    (300, 0.25, 75),
    (600, 0.2134, 128),  # enough rows: the 128 the rule asks for
    (1000, 0.128, 128),
    (1280, 0.1, 128),  # from here a tenth holds 128 or more
    (3000, 0.1, 300),
])
def test_the_default_validation_split_holds_out_128_rows_where_a_tenth_holds_fewer(rows: int, split: float,
                                                                                   held_out: int) -> None:
    assert default_validation_split(rows) == split
    assert validation_rows(rows, default_validation_split(rows)) == held_out
    assert held_out >= min(DEFAULT_VALIDATION_ROWS, round(rows * MAX_DEFAULT_VALIDATION_SPLIT))


USER, ASSISTANT = {"role": "user", "content": "2 plus 2?"}, {"role": "assistant", "content": "4"}
WRONG = {"role": "assistant", "content": "5"}


@pytest.mark.parametrize(("row", "fmt"), [
    ({"prompt": "2 plus 2 is", "chosen": " 4", "rejected": " 5"}, "preference"),
    ({"prompt": "", "chosen": "yes", "rejected": "no"}, "preference"),  # no prompt: an unconditioned preference
    ({"messages": [USER], "chosen": ASSISTANT, "rejected": WRONG}, "preference_messages"),
    ({"messages": [{"role": "system", "content": "terse"}, USER], "chosen": [ASSISTANT], "rejected": [WRONG]},
     "preference_messages"),  # OpenAI's preferred_output shape: a list ending with the assistant's answer
], ids=["text", "empty-prompt", "chat", "chat-lists"])
def test_preference_rows_are_accepted_in_both_forms(row: dict[str, object], fmt: str) -> None:
    report = validate_jsonl(((json.dumps(row) + "\n") * 3).encode())
    assert (report.ok, report.rows, report.format) == (True, 3, fmt)


@pytest.mark.parametrize(("row", "fragment"), [
    ({"prompt": "p", "chosen": "a"}, "'rejected' must be a non-empty string"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' must be a non-empty string"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' must be a string"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "the same answer"),
    ({"messages": [USER, ASSISTANT], "chosen": ASSISTANT, "rejected": WRONG}, "must not end with an assistant"),
    ({"messages": [USER], "chosen": USER, "rejected": WRONG}, "'chosen' must end with a non-empty assistant"),
    ({"messages": [USER], "chosen": ASSISTANT, "rejected": []}, "'rejected' must be a non-empty list"),
    ({"messages": [USER], "chosen": {"role": "robot", "content": "x"}, "rejected": WRONG}, "chosen[0].role"),
    ({"messages": [USER], "chosen": ASSISTANT, "rejected": ASSISTANT}, "the same answer"),
], ids=["no-rejected", "empty-chosen", "prompt-not-text", "same-answers", "prompt-ends-answered", "chosen-not-answer",
        "empty-rejected", "bad-role", "same-chat-answers"])
def test_a_bad_preference_row_is_its_lines_error(row: dict[str, object], fragment: str) -> None:
    good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    report = validate_jsonl(f"{good}\n{json.dumps(row)}\n{good}\n".encode())
    assert not report.ok and report.rows == 2 and report.error_count == 1
    assert report.errors[0].line == 2 and fragment in report.errors[0].message, report.errors


def test_preference_rows_and_completion_rows_do_not_mix() -> None:
    report = validate_jsonl(b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "completion": "c"}\n')
    assert report.errors[0].line == 2 and "'preference' format" in report.errors[0].message
