"""JSONL training data: validation on upload and the deterministic train/validation split.

No I/O here: the API validates an upload with `JsonlValidator` as it streams in, the worker parses and
splits with `parse_jsonl` and `split_rows`, and both split lines alike, so they agree on row counts (the
API derives each trial's step count from them).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

ROLES = {"system", "user", "assistant"}
MAX_REPORTED_ERRORS = 20
# The longest line (one row) an upload may have: 1 MiB is ~250k tokens, more than any model here trains on,
# and bounds the memory one upload's validation takes (the line, and the Python objects parsed from it).
MAX_LINE_BYTES = 1 << 20
# The deepest a row's arrays and objects may nest. A row of any format here is 3 deep ({"messages": [{...}]}), a
# few more with structured content; 64 is far past any real row and far below where `json.loads` (recursive,
# one C and interpreter frame per level) raises RecursionError (~1000) or, on a raised recursion limit, can
# overflow the C stack. It is checked by a linear scan before `json.loads` sees the line (`json_deeper_than`).
MAX_ROW_DEPTH = 64


@dataclass
class RowError:
    line: int
    message: str


@dataclass
class DatasetReport:
    rows: int = 0
    format: str | None = None  # "messages" | "prompt_completion" | "preference" | "preference_messages"
    errors: list[RowError] = field(default_factory=list)
    error_count: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.rows > 0


# The formats of preference rows (issue 36: what DPO trains on): a prompt and two answers to it, the preferred and the
# other, as plain text or as a chat.
PREFERENCE_FORMATS = ("preference", "preference_messages")


def _check_messages(messages: Any, name: str) -> str | None:
    """The error of a list of chat messages (None: fine)."""
    if not isinstance(messages, list) or not messages:
        return f"'{name}' must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"{name}[{i}] must be an object"
        if m.get("role") not in ROLES:
            return f"{name}[{i}].role must be one of {sorted(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"{name}[{i}].content must be a string"
    return None


def _check_answer(answer: Any, name: str) -> str | None:
    """A preference row's chosen or rejected answer in the chat form: an assistant message, or a list of messages
    ending with a non-empty assistant one (OpenAI's `preferred_output` shape)."""
    messages = [answer] if isinstance(answer, dict) else answer
    error = _check_messages(messages, name)
    if error:
        return error
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
        return f"'{name}' must end with a non-empty assistant message"
    return None


def _check_preference(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """A preference row: `prompt`, `chosen` and `rejected` as strings, or `messages` (the prompt) with `chosen` and
    `rejected` assistant answers."""
    if "messages" in row:
        error = _check_messages(row["messages"], "messages")
        if error is None and row["messages"][-1]["role"] == "assistant":
            error = "a preference row's 'messages' is the prompt: it must not end with an assistant message"
        for name in ("chosen", "rejected"):
            error = error or _check_answer(row.get(name), name)
        if error is None and row["chosen"] == row["rejected"]:
            error = "'chosen' and 'rejected' are the same answer: the row teaches nothing"
        return (None, error) if error else ("preference_messages", None)
    if not isinstance(row.get("prompt"), str):
        return None, "'prompt' must be a string"
    for name in ("chosen", "rejected"):
        if not isinstance(row.get(name), str) or not row[name]:
            return None, f"'{name}' must be a non-empty string"
    if row["chosen"] == row["rejected"]:
        return None, "'chosen' and 'rejected' are the same answer: the row teaches nothing"
    return "preference", None


def _check_row(row: Any) -> tuple[str | None, str | None]:
    """Returns (format, error) for one parsed row."""
    if not isinstance(row, dict):
        return None, "row must be a JSON object"
    if "chosen" in row or "rejected" in row:
        return _check_preference(row)
    if "messages" in row:
        messages = row["messages"]
        error = _check_messages(messages, "messages")
        if error:
            return None, error
        if not any(m["role"] == "assistant" and m["content"] for m in messages):
            return None, "a 'messages' row needs at least one non-empty assistant message to learn from"
        return "messages", None
    if "prompt" in row or "completion" in row:
        if not isinstance(row.get("prompt"), str):
            return None, "'prompt' must be a string"
        if not isinstance(row.get("completion"), str) or not row["completion"]:
            return None, "'completion' must be a non-empty string"
        return "prompt_completion", None
    return None, "row needs either 'messages' or 'prompt' and 'completion'"


class JsonlValidator:
    """Validates JSONL fed in pieces of any size (an upload as it arrives), line by line.

    Lines end with "\n" (a "\r" before it is JSON whitespace). Memory is bounded whatever the file's size:
    one line at most MAX_LINE_BYTES is held at a time, the rest of a longer line is skipped unread and the
    line reported as an error, and at most MAX_REPORTED_ERRORS errors are kept (all are counted).
    """

    def __init__(self) -> None:
        self.report = DatasetReport()
        self._line = bytearray()
        self._line_number = 0
        self._too_long = False

    def feed(self, data: bytes) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._take(data, start, end)
            self._end_line()
            start = end + 1
        self._take(data, start, len(data))

    def finish(self) -> DatasetReport:
        """The report, once the whole file was fed (a last line without its newline counts)."""
        if self._line or self._too_long:
            self._end_line()
        if self.report.rows == 0 and self.report.error_count == 0:
            self._fail(0, "file has no rows")
        return self.report

    def _take(self, data: bytes, start: int, end: int) -> None:
        if self._too_long or start == end:
            return
        if len(self._line) + end - start > MAX_LINE_BYTES:
            self._too_long = True
            self._line = bytearray()  # frees the partial line now, not at its end
            return
        self._line += memoryview(data)[start:end]

    def _end_line(self) -> None:
        self._line_number += 1
        if self._too_long:
            self._fail(self._line_number, f"line is longer than {MAX_LINE_BYTES} bytes")
        else:
            self._check_line(self._line)
        self._line = bytearray()
        self._too_long = False

    def _check_line(self, raw: bytearray) -> None:
        number, report = self._line_number, self.report
        try:
            row = _parse_line(raw)
        except UnicodeDecodeError as exc:
            self._fail(number, f"line is not UTF-8: {exc.reason} at byte {exc.start}")
            return
        except RowTooDeep as exc:
            self._fail(number, str(exc))
            return
        except json.JSONDecodeError as exc:
            self._fail(number, f"invalid JSON: {exc.msg}")
            return
        if row is _BLANK:
            return
        fmt, error = _check_row(row)
        if error:
            self._fail(number, error)
            return
        if report.format is None:
            report.format = fmt
        elif fmt != report.format:
            self._fail(number, f"row is in '{fmt}' format but the file started in '{report.format}' format")
            return
        report.rows += 1

    def _fail(self, line: int, message: str) -> None:
        self.report.error_count += 1
        if len(self.report.errors) < MAX_REPORTED_ERRORS:
            self.report.errors.append(RowError(line, message))


_BLANK = object()


class RowTooDeep(ValueError):
    pass


# The characters that open or close a level, and the quote that starts a string (whose brackets are text).
_STRUCTURE = re.compile(r'["\[\]{}]')


def json_deeper_than(text: str, limit: int) -> bool:
    """Whether `json.loads(text)` would nest arrays and objects deeper than `limit` before it returns or fails:
    a linear scan without recursion. Strings are skipped with `json`'s own string scanner, so they are read
    exactly as `json.loads` reads them; where the text stops being JSON (a string that does not end, a bracket
    that does not match, the end of the first value) `json.loads` stops too, so the count up to there is its depth.

    Cost: nothing past two `str.count`s for a row with at most `limit` brackets (every real row); otherwise one
    step per bracket or string, stopping at the first level past `limit`: the worst line of 1 MiB (one array of
    ~350,000 empty arrays) takes ~0.3 s on the 2-core dev machine, where json.loads takes ~0.07 s."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth, pos, search = 0, 0, _STRUCTURE.search
    while (found := search(text, pos)) is not None:
        char, pos = found.group(), found.end()
        if char == '"':
            try:
                pos = scanstring(text, pos)[1]
            except ValueError:  # not a JSON string: json.loads fails here, no deeper than counted so far
                return False
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
            if depth <= 0:  # the first value ended (or never began): json.loads reads no further
                return False
    return False


def _parse_line(raw: bytes | bytearray) -> Any:
    """One line's row, or _BLANK for a blank line. The validator and `parse_jsonl` share it, so the API's
    row count is the worker's.

    Raises:
        RowTooDeep: the row nests deeper than MAX_ROW_DEPTH (found before `json.loads` recurses into it).
    """
    text = raw.decode("utf-8")
    if not text.strip():
        return _BLANK
    if json_deeper_than(text, MAX_ROW_DEPTH):
        raise RowTooDeep(f"row nests arrays and objects deeper than {MAX_ROW_DEPTH} levels")
    return json.loads(text)


def parse_line(raw: bytes | bytearray) -> dict[str, Any] | None:
    """One line of a file that passed validation: its row, or None for a blank line (a file streamed line by line
    reads as `parse_jsonl` reads it whole)."""
    row = _parse_line(raw)
    return None if row is _BLANK else row


def validate_jsonl(data: bytes) -> DatasetReport:
    """Checks every line of a whole file in memory (the streaming `JsonlValidator`, fed once)."""
    validator = JsonlValidator()
    validator.feed(data)
    return validator.finish()


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    """The rows of a file that passed validation (lines split exactly as the validator splits them)."""
    rows = (_parse_line(line) for line in data.split(b"\n"))
    return [row for row in rows if row is not _BLANK]


# The default validation split (issue 33): a tenth of the training file's rows, raised to hold out at least
# DEFAULT_VALIDATION_ROWS where that still leaves three quarters to train on. Trials are ranked by their
# validation loss (smoothed, common.metrics.selection_loss); a few dozen rows cannot tell close trials apart, and a
# tenth of a few hundred rows is a few dozen. Below SMALL_VALIDATION_ROWS held-out rows, a task of several
# trials is warned (`task.small_validation`).
DEFAULT_VALIDATION_SPLIT = 0.1
DEFAULT_VALIDATION_ROWS = 128
MAX_DEFAULT_VALIDATION_SPLIT = 0.25
SMALL_VALIDATION_ROWS = 64


def default_validation_split(total: int) -> float:
    """The validation split of a task that names neither a split nor a validation file, for a training file of
    ``total`` rows: 0.1, or the fraction that holds out DEFAULT_VALIDATION_ROWS where 0.1 holds fewer, at most
    0.25 (rounded up to four decimals, so ``validation_rows`` reaches the rows it is for)."""
    if total * DEFAULT_VALIDATION_SPLIT >= DEFAULT_VALIDATION_ROWS:
        return DEFAULT_VALIDATION_SPLIT
    return min(MAX_DEFAULT_VALIDATION_SPLIT, math.ceil(DEFAULT_VALIDATION_ROWS / max(total, 1) * 1e4) / 1e4)


def validation_rows(total: int, fraction: float) -> int:
    """How many rows a validation split of `fraction` takes (at least one, leaving at least one)."""
    if total < 2:
        return 0
    return min(total - 1, max(1, round(total * fraction)))


def split_rows(
    rows: list[dict[str, Any]], fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deterministic (train, validation) split; every trial of a task sees the same one."""
    n_val = validation_rows(len(rows), fraction)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    val_idx = set(order[:n_val])
    train = [r for i, r in enumerate(rows) if i not in val_idx]
    val = [r for i, r in enumerate(rows) if i in val_idx]
    return train, val
