"""Writes `_sync.py`, the synchronous client, from `_async.py`, so that every method is written once (httpcore's
`unasync`, line by line). After changing `_async.py`:

    python -m loraplane.client._unasync            # rewrites _sync.py
    python -m loraplane.client._unasync --check    # exit status 1 when _sync.py is not what _async.py gives

(`tests/client/test_unasync.py` fails while they differ.) What it does to `_async.py`:

- the rewrites in RULES: `async def` -> `def`, `await x` -> `x`, `AsyncClient` -> `Client`, `aiter_bytes` ->
  `iter_bytes`, `_core.anotify` -> `_core.notify` (the sync/async pairs kept in `_core.py`)...;
- what cannot be rewritten (a docstring that says something else) is written both ways: the lines after
  `# unasync: async-only` are left out, and the lines after `# unasync: sync-only`, comments, are put in without
  their `# `, each block up to `# unasync: end`;
- a continuation line aligned with an open bracket moves with the bracket (when `await ` went before it);
- a one-line `from m import a, b` has its names deduplicated and sorted again, and `for x in y: yield x` becomes
  `yield from y` (an async generator cannot `yield from`).
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

SOURCE = Path(__file__).with_name("_async.py")
TARGET = Path(__file__).with_name("_sync.py")
HEADER = ("# Generated from _async.py by loraplane/client/_unasync.py: do not edit. Change _async.py, then run\n"
          "# `python -m loraplane.client._unasync`.\n")

RULES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"\basync (def|with|for)\b", r"\1"),
    (r"(?<![\w)\]])\(await ([\w.]+\([^()]*\))\)", r"\1"),  # (await x.get(id)).state -> x.get(id).state
    (r"\bawait ", ""),
    (r"\bAsync([A-Z]\w*)", r"\1"),  # AsyncClient, AsyncTasks..., AsyncIterator, httpx.AsyncBaseTransport
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\b__a(enter|exit)__\b", r"__\1__"),
    (r"\.a(close|read|iter_bytes|iter_lines)\(", r".\1("),  # httpx's coroutine methods
    (r"\b_core\.asleep\(", "time.sleep("),
    (r"\b_core\.a(notify|extract_archive)\(", r"_core.\1("),
)]

ASYNC_ONLY, SYNC_ONLY, END = "# unasync: async-only", "# unasync: sync-only", "# unasync: end"
IMPORT = re.compile(r"^from ([\w.]+) import ([\w, ]+)$", re.MULTILINE)
YIELD_LOOP = re.compile(r"^( *)for (\w+) in (.+):\n\1    yield \2\n(?!(?:[ \t]*\n)*\1(?:[ \t]|else\b))", re.MULTILINE)


def rewrite(text: str) -> str:
    """One line (or a piece of one) of async code as sync code."""
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    return text


def generate(source: str) -> str:
    """The text of `_sync.py` for the text of `_async.py`."""
    openers = _openers(source)
    written: dict[int, tuple[str, int]] = {}  # line -> (the line re-indented, how far it moved)
    out: list[str] = []
    block = None
    for number, line in enumerate(source.splitlines(keepends=True)):
        if (marker := line.strip()) in (ASYNC_ONLY, SYNC_ONLY, END):
            if marker == END and block is None:
                raise ValueError(f"line {number + 1}: {END} without a block to end")
            block = None if marker == END else marker
        elif block == SYNC_ONLY:
            out.append(_uncomment(line, number))
        elif block is None:
            shift = 0
            if number in openers and openers[number][0] in written:
                row, col = openers[number]
                indent = len(line) - len(line.lstrip(" "))
                if indent - col in (0, 1):  # aligned with the bracket (a closing one), or just after it
                    opened, moved = written[row]
                    shift = len(rewrite(opened[:col + moved])) - col
                    line = " " * (indent + shift) + line.lstrip(" ")
            written[number] = (line, shift)
            out.append(rewrite(line))
    if block is not None:
        raise ValueError(f"{block} without {END}")
    text = IMPORT.sub(_sorted_import, "".join(out))
    return HEADER + YIELD_LOOP.sub(r"\1yield from \3\n", text)


def _openers(source: str) -> dict[int, tuple[int, int]]:
    """Each line that starts inside brackets -> the line and column of the innermost open one (from 0)."""
    stack: list[tuple[int, int]] = []
    openers: dict[int, tuple[int, int]] = {}
    last = -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        row, col = token.start[0] - 1, token.start[1]
        if row != last and stack:
            openers[row] = stack[-1]
        last = token.end[0] - 1
        if token.type == tokenize.OP and token.string in "([{":
            stack.append((row, col))
        elif token.type == tokenize.OP and token.string in ")]}":
            stack.pop()
    return openers


def _uncomment(line: str, number: int) -> str:
    body = line.lstrip(" ")
    if not body.startswith("#"):
        raise ValueError(f"line {number + 1}: a {SYNC_ONLY} line must be a comment")
    text = body[2:] if body.startswith("# ") else body[1:]
    return line[:len(line) - len(body)] + text if text.strip() else "\n"


def _sorted_import(match: re.Match[str]) -> str:
    """isort's order (ruff's default): CONSTANTS, Classes, then the rest, each ignoring case."""
    names = dict.fromkeys(name.strip() for name in match[2].split(","))
    order = sorted(names, key=lambda n: (0 if n.isupper() and len(n) > 1 else 1 if n[0].isupper() else 2, n.lower()))
    return f"from {match[1]} import {', '.join(order)}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    generated = generate(SOURCE.read_text(encoding="utf-8"))
    if args == ["--check"]:
        if TARGET.read_text(encoding="utf-8") == generated:
            return 0
        sys.stderr.write(f"{TARGET} is not what {SOURCE.name} gives: run `python -m loraplane.client._unasync`\n")
        return 1
    if args:
        sys.stderr.write("usage: python -m loraplane.client._unasync [--check]\n")
        return 2
    TARGET.write_text(generated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
