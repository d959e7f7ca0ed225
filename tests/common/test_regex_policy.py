"""common/regex_policy.py: a hostile pattern is refused before anything compiles it, in milliseconds and without
growing the process; each limit holds at its edge; ordinary patterns (and the largest allowed ones) compile
cheaply.

The costly cases run in a fresh Python process with its address space capped (RLIMIT_AS): there the peak RSS
growth of each check is measured, and a policy that let `regex` compile `a{1000000000}` fails with a
MemoryError in that child (reported as a failed case) instead of taking this machine's memory.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from common.regex_policy import (
    LIMITS,
    MAX_BRANCHES,
    MAX_EXPANSION,
    MAX_NESTING_DEPTH,
    MAX_PATTERN_LENGTH,
    MAX_REPEAT_COUNT,
    SYNTAX,
    PatternRefused,
    check_pattern,
    compile_pattern,
)

ROOT = Path(__file__).resolve().parents[2]

# (pattern, the limit it is over): the two and the other hostile forms.
HOSTILE = [
    ("a{1000000000}", "repetition"),
    ("(?:a{60000}){60000}", "repetition"),
    ("a{99999999999}", "repetition"),  # past the parser's own maximum (an OverflowError inside it)
    ("(a{1000}){1000}", "expansion"),
    ("(?:(?:a{30}){30}){30}", "expansion"),  # each count small, their product not
    ("(?:a{1000}|b{1000}){1000}", "expansion"),
    ("a{1000}" * 21, "expansion"),  # in sequence, not nested
    ("(?>a{100000})", "repetition"),  # atomic group
    ("a{100000}+", "repetition"),  # possessive
    ("a{100000}?", "repetition"),  # lazy
    ("(?=a{100000})", "repetition"),  # lookahead
    ("a{100000,}", "repetition"),  # a lower bound alone
    ("(?:a+){1000}a{1000}" * 7, "expansion"),  # 7 * (2001 + 1001) items
    ("(" * 5000 + "a" + ")" * 5000, "length"),  # thousands deep: refused before any recursive parser
    ("(" * 201 + "a" + ")" * 201, "nesting"),
    ("|".join(["ab"] * 101), "alternation"),
    ("(?:" + "|".join("x" * 101) + ")", "alternation"),
    ("x" * (MAX_PATTERN_LENGTH + 1), "length"),
]

# Ordinary patterns, and the largest the limits allow: each compiles (with both engines).
ALLOWED = [
    r"\d+", r"^(yes|no)\b", "(?i)paris", r"\{\s*\"answer\"\s*:\s*\d+\s*\}", r'{"name": ".*"}',
    r"(?:\w+\s){0,1000}", r"^\d{4}-\d{2}-\d{2}$", r"(?:(?:\d{1,3}\.){3}\d{1,3}\s*){1,500}",
    "a{1000}", "a{1000,}", "a{0,1000}", "a{1000}+", "(?>a{1000})",
    "(?:a{1000}){19}", "(?:(?:a?){100}){99}", "(?:[a-z]{1000}){19}",  # just under MAX_EXPANSION
    "(?:ab){e<=2}", "(?:a{1000}){e<=1000000}",  # fuzzy constraints: literal to `re`, multiply nothing in `regex`
    "(" * MAX_NESTING_DEPTH + "a" + ")" * MAX_NESTING_DEPTH,
    "|".join(f"w{i:02d}" for i in range(MAX_BRANCHES)),
    "x" * MAX_PATTERN_LENGTH,
]

_CHILD = r'''
import json, resource, sys, time
from common.regex_policy import PatternRefused, compile_pattern

results = []
for pattern in json.loads(sys.stdin.read()):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        compile_pattern(pattern)
        outcome = "compiled"
    except PatternRefused as exc:
        outcome = exc.limit
    except MemoryError:
        outcome = "MemoryError"
    seconds = time.perf_counter() - start
    grew_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    results.append({"outcome": outcome, "seconds": seconds, "grew_mb": grew_kb / 1024})
print(json.dumps(results))
'''

CHILD_ADDRESS_SPACE = 1 << 30  # 1 GiB: Python with `regex` needs ~50 MB; the pattern wanted 17 GB


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))


def _measure(patterns: list[str]) -> list[dict[str, object]]:
    """Each pattern through `compile_pattern` in a fresh, memory-capped process: its outcome (the limit, or
    "compiled"), seconds and peak RSS growth."""
    done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(patterns), capture_output=True,
                          text=True, cwd=ROOT, preexec_fn=_cap_memory, timeout=120, check=True)
    results: list[dict[str, object]] = json.loads(done.stdout)
    return results


def test_hostile_patterns_are_refused_in_milliseconds_with_bounded_memory() -> None:
    results = _measure([pattern for pattern, _ in HOSTILE])
    for (pattern, limit), result in zip(HOSTILE, results, strict=True):
        assert result["outcome"] == limit, (pattern[:60], result)
        # Measured ~0.1 ms and no growth; the bounds leave room for a loaded 2-core machine.
        assert isinstance(result["seconds"], float) and result["seconds"] < 0.05, (pattern[:60], result)
        assert isinstance(result["grew_mb"], float) and result["grew_mb"] < 2, (pattern[:60], result)


def test_the_largest_allowed_patterns_compile_cheaply() -> None:
    results = _measure(ALLOWED)
    for pattern, result in zip(ALLOWED, results, strict=True):
        assert result["outcome"] == "compiled", (pattern[:60], result)
        # Measured under 10 ms and +5.5 MB at the expansion limit.
        assert isinstance(result["seconds"], float) and result["seconds"] < 1.0, (pattern[:60], result)
        assert isinstance(result["grew_mb"], float) and result["grew_mb"] < 32, (pattern[:60], result)


@pytest.mark.parametrize(("pattern", "limit", "message"), [
    ("a{1000000000}", "repetition", "repetition count 1000000000 is over the limit of 1000"),
    ("(?:a{60000}){60000}", "repetition", "repetition count 60000 is over the limit of 1000"),
    ("a{5,1001}", "repetition", "repetition count 1001 is over the limit of 1000"),
    ("(a{1000}){1000}", "expansion", "repetitions expand the pattern to 1002001 items, over the limit of 20000"),
    ("(" * 201 + ")" * 201, "nesting", "groups nested 201 deep is over the limit of 200"),
    ("|".join("ab" for _ in range(101)), "alternation", "an alternation of 101 branches is over the limit of 100"),
    ("x" * 501, "length", "pattern length 501 is over the limit of 500 characters"),
    ("(unclosed", SYNTAX, "missing ), unterminated subpattern"),
    ("(?<=a+)b", SYNTAX, "look-behind requires fixed-width pattern"),  # `re`'s rule (`regex` alone takes it)
    (r"\p{L}", SYNTAX, "bad escape"),  # `regex`'s own syntax is not Python `re`'s
])
def test_a_refusal_names_its_limit(pattern: str, limit: str, message: str) -> None:
    with pytest.raises(PatternRefused) as refused:
        check_pattern(pattern)
    assert refused.value.limit == limit and message in str(refused.value)
    assert limit in (*LIMITS, SYNTAX)


def test_each_limit_holds_at_its_edge() -> None:
    assert (MAX_PATTERN_LENGTH, MAX_NESTING_DEPTH, MAX_BRANCHES, MAX_REPEAT_COUNT, MAX_EXPANSION) == (
        500, 200, 100, 1000, 20_000)
    edges = [
        (f"a{{{MAX_REPEAT_COUNT}}}", f"a{{{MAX_REPEAT_COUNT + 1}}}"),
        (f"a{{{MAX_REPEAT_COUNT},}}", f"a{{{MAX_REPEAT_COUNT + 1},}}"),
        ("(" * MAX_NESTING_DEPTH + ")" * MAX_NESTING_DEPTH, "(" * 201 + ")" * 201),
        ("|".join("a" * MAX_BRANCHES), "|".join("a" * (MAX_BRANCHES + 1))),
        # 1 + 19 * (1 + 1000) = 19020 and 1 + 20 * 1001 = 20021 items around MAX_EXPANSION
        ("(?:a{1000}){19}", "(?:a{1000}){20}"),
        ("x" * MAX_PATTERN_LENGTH, "x" * (MAX_PATTERN_LENGTH + 1)),
    ]
    for allowed, refused in edges:
        check_pattern(allowed)
        with pytest.raises(PatternRefused):
            check_pattern(refused)


@pytest.mark.parametrize("pattern", [
    "\\(" * 220,  # escaped parentheses are characters, not groups
    "[(]" * 160,  # so are those in a class
    "[]()|]" * 80,  # a ']' first in a class is a member
    "[^]()|]" * 70,
    "[\\]()|]" * 70,
    "\\|" * 240,  # escaped '|' is no branch
])
def test_the_scan_counts_only_real_groups_and_branches(pattern: str) -> None:
    check_pattern(pattern)
    compile_pattern(pattern)


def test_a_pattern_is_compiled_outside_regex_s_module_cache() -> None:
    # The cache keeps up to 500 compiled patterns: a process that checks tenants' patterns would keep them all.
    first, second = compile_pattern(r"\d{3}"), compile_pattern(r"\d{3}")
    assert first is not second and first.search("a123") is not None


def test_compiling_takes_milliseconds_on_wide_case_folded_classes() -> None:
    # Python's `re.compile` case-folds every code point of each range (~9 ms a class); `regex` does not, and it
    # is the only compile.
    pattern = "(?i)" + r"[\x00-\U0010ffff]" * 29
    assert len(pattern) <= MAX_PATTERN_LENGTH
    [result] = _measure([pattern])
    assert result["outcome"] == "compiled"
    assert isinstance(result["seconds"], float) and result["seconds"] < 0.1, result
