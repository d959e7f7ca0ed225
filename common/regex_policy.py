"""The regex metric's pattern policy: what a tenant's pattern may cost, checked BEFORE anything compiles it (pure,
no torch, no I/O).

Why: the `regex` package the worker searches with expands a repetition's count into code at compile time,
~270 bytes and ~0.4 µs per repeated item, with no limit of its own: `a{1000000000}` or `(?:a{60000}){60000}` grew
a process to 17 GB before the kernel killed it (issue 29). Python's `re` does not expand (a repeat is one opcode),
and its parser (`re._parser`, the old `sre_parse`) builds the parse tree without expanding anything: both issue
patterns parse in ~50 µs and no memory. So a pattern is checked in this order, each step bounded by the ones
before it, and only a pattern that passes them all is compiled:

    length       at most MAX_PATTERN_LENGTH characters (O(1)); bounds everything below
    nesting      a linear scan: groups nested at most MAX_NESTING_DEPTH deep (the parsers recurse per group)
    alternation  the same scan: at most MAX_BRANCHES alternatives in one alternation
    syntax       `re._parser.parse`: linear in the (bounded) length, expands nothing; and what `re`'s compiler
                 adds to it (a look-behind must have a fixed width)
    repetition   each count of the tree's repeats ({m}, {m,}, {,n}, {m,n}, greedy, lazy or possessive) at most
                 MAX_REPEAT_COUNT
    expansion    the pattern's size with every repeat's body counted as often as its bound says (nested repeats
                 multiply) at most MAX_EXPANSION items: what `regex` would expand
    compile      `regex` only (not through its module cache, which keeps up to 500 compiled patterns). Not
                 `re.compile` as well: it adds no check beyond the look-behind's, and it is the slower of
                 the two on wide classes: `(?i)` with 20 classes `[\\x00-\\U0010ffff]` (344 characters) took
                 `re` 186 ms (it case-folds every code point of a range), `regex` 1 ms

The same `compile_pattern` runs at submission (api/schemas/tasks.py: a refusal is a 422 naming the limit) and in
the worker before it scores (worker/pack_runner.py: a pattern refused there, e.g. of a task stored before this policy,
is never compiled; the trials go without a metric score).

What `regex` reads differently from `re` in a pattern both accept: fuzzy constraints such as `(?:ab){e<=2}`,
which `re` parses as literal characters. They multiply nothing at compile time (measured: `(?:a{1000}){e<=1000000}`
compiles in 0.4 ms, +0.2 MB), and `re`'s literal reading of them only adds to the measured expansion, so the
expansion here is an upper bound on `regex`'s; what fuzzy matching costs at search time the search timeout
(common/metrics.py REGEX_TIMEOUT_S) bounds. Everything else `regex` adds (\\p{..}, (?|..), (?R), (?V1), ...)
`re` refuses, so it is refused here.

Measured (Python 3.11, regex 2026.11.19, one core of the 2-core dev machine; compile time and peak RSS growth
of a fresh process): `a{10000}` 3.3 ms +2.8 MB; `a{65535}` 18 ms +17 MB; `a{100000}` 30 ms +26 MB; `a{1000000}`
0.42 s +262 MB; `(?:a{1000}){1000}` 0.38 s +262 MB; `(?:a?){100000}` 63 ms +51 MB (two items per repeat). Only the
fixed part is expanded: `a{0,100000}` and `a{1,100000}` 0.1 ms, `a{50000,100000}` 18 ms +13 MB; counting a
finite maximum anyway keeps this independent of that detail. At the limits below the worst patterns measured
compile in under 10 ms and +5.5 MB, and every refusal takes under 0.2 ms (tests/common/test_regex_policy.py).
"""

from __future__ import annotations

import re
from re import _parser as sre_parser  # type: ignore[attr-defined]  # `re.compile`'s own parser (Python 3.11+)
from typing import Any

import regex

# 500 characters hold any pattern a person writes for an answer of at most 512 tokens; a longer one is most
# likely generated, and this bound is what keeps every step below linear and small.
MAX_PATTERN_LENGTH = 500
# Real patterns nest a handful of groups; 200 is what a (generated) pattern of 500 characters may use and what
# the tests accept. At 200 levels `regex`'s recursive parser needs ~625 of Python's 1000 frames, so a caller's
# stack has ~375 left (a RecursionError anyway is caught and refused, never raised).
MAX_NESTING_DEPTH = 200
# A list of alternatives ("yes|no|maybe|...") of 100 words fills the 500 characters; more is generated.
MAX_BRANCHES = 100
# The longest answer is MAX_NEW_TOKENS_LIMIT = 512 tokens (a few thousand characters): a count over 1000 matches
# almost nothing a model answers, while `regex` expands it (a{1000}: 0.3 ms, +0.2 MB).
MAX_REPEAT_COUNT = 1000
# The measured cost is linear in the expanded size: just under 20,000 items compile in ~7-9 ms and +5.5 MB
# (`(?:a{1000}){19}`, `(?:(?:a?){100}){99}`, `(?:[a-z]{1000}){19}`). `(?:\w+\s){0,1000}` is ~4,000 items and
# `(?:(?:\d{1,3}\.){3}\d{1,3}\s*){1,500}` (up to 500 addresses) ~11,000.
MAX_EXPANSION = 20_000

LIMITS = ("length", "nesting", "alternation", "repetition", "expansion")
SYNTAX = "syntax"

_REPEATS = (sre_parser.MAX_REPEAT, sre_parser.MIN_REPEAT, sre_parser.POSSESSIVE_REPEAT)


class PatternRefused(ValueError):
    """A pattern the policy does not compile: `limit` is the limit it is over (one of LIMITS), or SYNTAX for
    one that is not a valid expression; the message says which and by how much."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def _scan(pattern: str) -> tuple[int, int]:
    """(deepest group nesting, most alternatives in one alternation) of `pattern`, by one linear pass that
    skips escapes and character classes: before any recursive parser sees it."""
    depth = deepest = 0
    branches = [1]  # the alternatives so far of each open group's alternation, the whole pattern's first
    most = 1
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            i = _class_end(pattern, i)
            continue
        if char == "(":
            depth += 1
            deepest = max(deepest, depth)
            branches.append(1)
        elif char == ")" and depth > 0:
            depth -= 1
            branches.pop()
        elif char == "|":
            branches[-1] += 1
            most = max(most, branches[-1])
        i += 1
    return deepest, most


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at `start` (a `]` first in the class, or after `^`,
    is a member, as in `re`); the end of the pattern if it never closes (the parser then says so)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern[i] == "]":
            return i + 1
        i += 1
    return i


def _expansion(items: Any) -> int:
    """The size of parsed `items` with every repeat's body counted as often as its bound (its maximum when
    finite, else its minimum), after checking each count. The recursion follows the tree, whose depth the
    nesting limit has bounded."""
    size = 0
    for op, arg in items:
        size += 1
        if op in _REPEATS:
            low, high, body = arg
            for count in (low, high):
                if count != sre_parser.MAXREPEAT and count > MAX_REPEAT_COUNT:
                    raise PatternRefused("repetition", f"repetition count {count} is over the limit of "
                                         f"{MAX_REPEAT_COUNT}")
            bound = high if high != sre_parser.MAXREPEAT else low
            size += max(bound, 1) * _expansion(body)
        elif op == sre_parser.SUBPATTERN:
            size += _expansion(arg[3])
        elif op == sre_parser.BRANCH:
            size += sum(_expansion(branch) for branch in arg[1])
        elif op == sre_parser.ATOMIC_GROUP:
            size += _expansion(arg)
        elif op in (sre_parser.ASSERT, sre_parser.ASSERT_NOT):
            low, high = arg[1].getwidth()
            if arg[0] < 0 and low != high:  # as `re`'s compiler says (`regex` alone would take it)
                raise PatternRefused(SYNTAX, "look-behind requires fixed-width pattern")
            size += _expansion(arg[1])
        elif op == sre_parser.GROUPREF_EXISTS:
            size += _expansion(arg[1]) + (_expansion(arg[2]) if arg[2] else 0)
    return size


def check_pattern(pattern: str) -> None:
    """Refuse `pattern` if it is over a limit or not a valid expression, without compiling it: its cost is
    linear in at most MAX_PATTERN_LENGTH characters.

    Raises:
        PatternRefused: naming the limit (or SYNTAX) and by how much.
    """
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternRefused("length", f"pattern length {len(pattern)} is over the limit of {MAX_PATTERN_LENGTH} "
                             "characters")
    deepest, most = _scan(pattern)
    if deepest > MAX_NESTING_DEPTH:
        raise PatternRefused("nesting", f"groups nested {deepest} deep is over the limit of {MAX_NESTING_DEPTH}")
    if most > MAX_BRANCHES:
        raise PatternRefused("alternation", f"an alternation of {most} branches is over the limit of "
                             f"{MAX_BRANCHES}")
    try:
        parsed = sre_parser.parse(pattern)
    except re.error as exc:
        raise PatternRefused(SYNTAX, str(exc)) from None
    except OverflowError:  # a count past the parser's own maximum (2**32 - 1)
        raise PatternRefused("repetition", f"a repetition count is over the limit of {MAX_REPEAT_COUNT}") from None
    except RecursionError:  # the scan is not fooled by well-formed patterns; this is the backstop
        raise PatternRefused("nesting", f"nested too deeply to parse (the limit is {MAX_NESTING_DEPTH})") from None
    size = _expansion(parsed.data)
    if size > MAX_EXPANSION:
        raise PatternRefused("expansion", f"repetitions expand the pattern to {size} items, over the limit of "
                             f"{MAX_EXPANSION}")


def compile_pattern(pattern: str) -> regex.Pattern[str]:
    """`pattern` compiled by the `regex` package once `check_pattern` has passed it (so it is Python `re`
    syntax, within the limits); never through `regex`'s module cache.

    Raises:
        PatternRefused: over a limit, or not a valid expression for either engine (SYNTAX).
    """
    check_pattern(pattern)
    try:
        return regex.compile(pattern, cache_pattern=False)
    except (re.error, regex.error) as exc:
        raise PatternRefused(SYNTAX, str(exc)) from None
    except RecursionError:
        raise PatternRefused("nesting", f"nested too deeply to compile (the limit is {MAX_NESTING_DEPTH})") from None
    except OverflowError as exc:
        raise PatternRefused("repetition", f"too complex to compile ({exc})") from None
