"""Shared by the benchmarks: where results go and what each result file records."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent
# Where results are written: the committed folder, unless a test sends a benchmark's run elsewhere.
RESULTS = Path(os.environ.get("LORAPLANE_BENCH_RESULTS") or PACKAGE / "results")


def device_description() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
        return f"CPU {platform.processor() or platform.machine()} x{_cpu_count()} (torch {torch.__version__})"
    except ImportError:
        return f"CPU {platform.machine()} x{_cpu_count()}"


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def git_commit() -> str:
    """HEAD, or ``LORAPLANE_COMMIT`` where set: the device machine's copy of the tree can carry a stale ``.git``
    (seen on 2026-11-22: every run there reported the session's first commit), so GPU scripts pass it."""
    if os.environ.get("LORAPLANE_COMMIT"):
        return os.environ["LORAPLANE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    """How the benchmark was started (`python -m benchmarks.x ...`, as its docstring says to run it)."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(PACKAGE):  # benchmarks/x.py or benchmarks/quality/run.py: run as a module
        module = ".".join(script.relative_to(PACKAGE.parent).with_suffix("").parts)
        head = ["python", "-m", module]
    else:
        head = ["python", sys.argv[0]]
    return " ".join(shlex.quote(a) for a in [*head, *sys.argv[1:]])


def print_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    table = "\n".join(lines)
    print(table)
    return table


def settings_in_environment() -> dict[str, str]:
    """The engine's and the service's settings (``LORAPLANE_*``) set in the environment: part of what was run, which
    the command line alone does not say (``LORAPLANE_LORA_BACKEND=triton``). The benchmark's own plumbing (the
    commit, where results and models go) is left out, and so is anything that may hold a credential."""
    plumbing = ("LORAPLANE_COMMIT", "LORAPLANE_BENCH_DIR", "LORAPLANE_BENCH_RESULTS")
    secret = ("URL", "TOKEN", "KEY", "SECRET", "PASSWORD")
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("LORAPLANE_") and k not in plumbing and not any(word in k for word in secret)}


def write_result(name: str, headers: list[str], rows: list[list[Any]], notes: dict[str, Any]) -> Path:
    """Writes benchmarks/results/<name>-<device>-<date>.json with the device, date and command."""
    table = print_table(headers, rows)
    now = datetime.now(UTC)
    device = device_description()
    record = {
        "benchmark": name,
        "date": now.isoformat(timespec="seconds"),
        "device": device,
        "command": command_line(),
        "environment": settings_in_environment(),
        "commit": git_commit(),
        "headers": headers,
        "rows": rows,
        "table": table,
        **notes,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if "CPU" not in device else "cpu"
    path = RESULTS / f"{name}-{tag}-{now:%Y%m%d}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwritten to {path}")
    return path
