"""Tenant patterns under the two engines, side by side (issue 52): the `regex` package, which compiled what the old
policy (Python `re`'s parser) accepted, against RE2, which now parses, judges and compiles in one step
(common/regex_policy.py).

Each pattern runs in a fresh child process under a 1.5 GiB address-space cap (what the issue measured under):
compile, then search an adversarial answer (5,000 a's and a '!'), reporting the outcome, the compile's and the
search's seconds and the peak resident growth. Issue 52's table first: the verbose-mode counts the old judge read
as literal text, which `regex` expands. No GPU; run on the CPU:

    python -m benchmarks.regex_engines
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import write_result

ROOT = Path(__file__).resolve().parents[1]
CAP_BYTES = 3 << 29  # 1.5 GiB, as the measurement
ANSWER = "a" * 5000 + "!"

PATTERNS = [
    ("issue 52: verbose count 1e9", "(?x)a{1 000 000 000}"),
    ("issue 52: verbose count 1e8", "(?x)a{ 100000000 }"),
    ("issue 52: verbose nested", "(?x)(?:a{1 000}){1 000}"),
    ("issue 29: count 1e9", "a{1000000000}"),
    ("nested product 1e6", "(?:a{1000}){1000}"),
    ("backtracking", "(a|aa)+$"),
    ("ordinary", r"^\d{4}-\d{2}-\d{2}$"),
    ("ordinary, case-folded", "(?i)the answer is (yes|no)"),
    ("largest RE2 takes", r"(?:\w+\s){0,1000}"),
]

_CHILD = r'''
import json, sys, time

def peak_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

engine, pattern, answer = sys.argv[1], sys.argv[2], sys.argv[3]
if engine == "regex":
    import regex
    compile_ = lambda p: regex.compile(p, cache_pattern=False)
    search = lambda c, a: c.search(a, timeout=0.05)  # the old metric's 50 ms cut-off
else:
    from common.regex_policy import compile_pattern as compile_
    search = lambda c, a: c.search(a)
before = peak_mb()
start = time.perf_counter()
result = {"outcome": "compiled"}
try:
    compiled = compile_(pattern)
    result["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        result["matched"] = search(compiled, answer) is not None
    except TimeoutError:
        result["matched"] = "timed out"
    result["search_s"] = time.perf_counter() - start
except MemoryError:
    result = {"outcome": "MemoryError", "compile_s": time.perf_counter() - start}
except Exception as exc:
    result = {"outcome": "refused: " + str(exc)[:70], "compile_s": time.perf_counter() - start}
result["peak_growth_mb"] = peak_mb() - before
print(json.dumps(result))
'''


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP_BYTES, CAP_BYTES))


def measure(engine: str, pattern: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _CHILD, engine, pattern, ANSWER], capture_output=True, text=True,
                          cwd=ROOT, preexec_fn=_cap, timeout=600)
    if done.returncode != 0:  # killed, or aborted by an allocation C code could not make
        return {"outcome": f"died ({done.returncode}): {done.stderr.strip()[-60:]}"}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main() -> None:
    headers = ["pattern", "case", "engine", "outcome", "compile_ms", "search_ms", "peak_growth_mb"]
    rows: list[list[Any]] = []
    for case, pattern in PATTERNS:
        for engine in ("regex", "re2"):
            r = measure(engine, pattern)
            rows.append([pattern, case, engine, r["outcome"] if "matched" not in r else f"matched={r['matched']}",
                         round(1000 * r.get("compile_s", 0.0), 2), round(1000 * r.get("search_s", 0.0), 2),
                         round(r.get("peak_growth_mb", 0.0), 1)])
    write_result("regex_engines", headers, rows, {
        "cap_bytes": CAP_BYTES, "answer": "5000 a's then '!'",
        "note": "Each cell a fresh process under the cap. 'regex' is the engine the old policy compiled with once "
                "Python re's parser had accepted the pattern (it accepted issue 52's three); 're2' is "
                "common/regex_policy.compile_pattern, which judges and compiles in one step."})


if __name__ == "__main__":
    main()
