"""JSONL training data: validation on upload and the deterministic train/validation split.

Pure functions: the API validates with them and the worker splits with them, so both agree on
row counts (the API derives each trial's step count from them).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

ROLES = {"system", "user", "assistant"}
MAX_REPORTED_ERRORS = 20


@dataclass
class RowError:
    line: int
    message: str


@dataclass
class DatasetReport:
    rows: int = 0
    format: str | None = None  # "messages" | "prompt_completion"
    errors: list[RowError] = field(default_factory=list)
    error_count: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.rows > 0


def _check_row(row: Any) -> tuple[str | None, str | None]:
    """Returns (format, error) for one parsed row."""
    if not isinstance(row, dict):
        return None, "row must be a JSON object"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return None, "'messages' must be a non-empty list"
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                return None, f"messages[{i}] must be an object"
            if m.get("role") not in ROLES:
                return None, f"messages[{i}].role must be one of {sorted(ROLES)}"
            if not isinstance(m.get("content"), str):
                return None, f"messages[{i}].content must be a string"
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


def validate_jsonl(data: bytes) -> DatasetReport:
    """Checks every line; reports the first MAX_REPORTED_ERRORS errors with their line numbers."""
    report = DatasetReport()

    def fail(line: int, message: str) -> None:
        report.error_count += 1
        if len(report.errors) < MAX_REPORTED_ERRORS:
            report.errors.append(RowError(line, message))

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(0, f"file is not UTF-8: {exc}")
        return report
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            fail(number, f"invalid JSON: {exc.msg}")
            continue
        fmt, error = _check_row(row)
        if error:
            fail(number, error)
            continue
        if report.format is None:
            report.format = fmt
        elif fmt != report.format:
            fail(number, f"row is in '{fmt}' format but the file started in '{report.format}' format")
            continue
        report.rows += 1
    if report.rows == 0 and report.error_count == 0:
        fail(0, "file has no rows")
    return report


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


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
