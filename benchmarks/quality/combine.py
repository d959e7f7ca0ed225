"""Several quality runs' cells as one table (issue 33): a session scores a part of the matrix, and the parts add up.

    python -m benchmarks.quality.combine benchmarks/results/issue33/part*.json \\
        --out benchmarks/results/issue33/combined.json

Each (task, size, seed) cell is taken once (the same cell in two files is an error: they would be two draws of one
seed). Per task and size it prints each arm's mean and 95% interval over the seeds (Student's t), and the paired
difference of each trained arm against the default single trial and against the oracle (seed by seed, on the same
splits): the issue's bars read off these. The output file lists its sources (file, device, date, commit, command);
no number in it is new.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from benchmarks.quality.run import ARMS
from benchmarks.quality.stats import mean_ci, paired_diff_ci

VERSUS = ("default", "oracle")


def merge(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every cell of the files, and each file's provenance."""
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    sources = []
    for path in paths:
        result = json.loads(path.read_text())
        sources.append({key: result.get(key) for key in ("date", "device", "commit", "command", "environment")}
                       | {"file": path.name, "complete": result.get("complete"), "cells": len(result["cells"])})
        for cell in result["cells"]:
            key = (cell["task"], cell["size"], cell["seed"])
            if key in cells:
                raise ValueError(f"{key} is in two files: keep one")
            cells[key] = cell
    return [cells[k] for k in sorted(cells)], sources


def _fmt(mean: float, half: float) -> str:
    return f"{mean:+.3f}" + ("" if half != half else f" ±{half:.3f}")  # nan: one seed


def tables(cells: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]], list[str], list[list[Any]]]:
    arms = [a for a in ARMS if any(a in c["scores"] for c in cells)]
    groups = sorted({(c["task"], c["size"]) for c in cells})
    means: list[list[Any]] = []
    diffs: list[list[Any]] = []
    for task, size in groups:
        mine = [c for c in cells if (c["task"], c["size"]) == (task, size)]
        row: list[Any] = [task, size, sum(bool(set(c["scores"]) - {"base"}) for c in mine)]  # seeds trained
        for arm in arms:
            values = [c["scores"][arm] for c in mine if arm in c["scores"]]
            mean, half = mean_ci(values) if values else (float("nan"), float("nan"))
            row.append("" if not values else f"{mean:.3f}" + ("" if half != half else f" ±{half:.3f}"))
        means.append(row)
        for versus in VERSUS:
            diff_row: list[Any] = [task, size, f"- {versus}"]
            for arm in arms:
                pairs = [(c["scores"][arm], c["scores"][versus]) for c in mine
                         if arm in c["scores"] and versus in c["scores"]]
                if arm == versus or not pairs:
                    diff_row.append("")
                    continue
                diff_row.append(_fmt(*paired_diff_ci([a for a, _ in pairs], [b for _, b in pairs])))
            diffs.append(diff_row)
    return ["task", "size", "seeds", *arms], means, ["task", "size", "against", *arms], diffs


def early_exit(cells: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    """How ``grid-<policy>`` did against the full grid (``grid-none``) of the same cells: whether it kept the grid's
    winner (the same configuration, or one whose best validation loss is within 1% of it: the issue's bar), what its
    winner scored on the test rows against the grid's, and the share of training rows it saved."""
    arm = f"grid-{policy}"
    pairs = [(c["winners"][arm], c["winners"]["grid-none"], c["scores"][arm] - c["scores"]["grid-none"]) for c in cells
             if arm in c["winners"] and "grid-none" in c["winners"] and "samples" in c["winners"][arm]]
    kept = sum(mine["hyperparameters"] == full["hyperparameters"]
               or mine["best_val_loss"] <= full["best_val_loss"] * 1.01 for mine, full, _ in pairs)
    saved = [1 - mine["samples"] / full["samples"] for mine, full, _ in pairs]
    return {"policy": policy, "cells": len(pairs), "kept": kept,
            "test_vs_grid": [round(d, 4) for _, _, d in pairs],
            "saved_mean": round(sum(saved) / len(saved), 4) if saved else None,
            "saved_min": round(min(saved), 4) if saved else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="where to write the combined table (JSON)")
    args = parser.parse_args()
    cells, sources = merge(args.results)
    headers, means, diff_headers, diffs = tables(cells)
    table = print_table(headers, means)
    print()
    diff_table = print_table(diff_headers, diffs)
    stops = [early_exit(cells, policy) for policy in ("alto", "asha")]
    for stop in (s for s in stops if s["cells"]):
        kept, cells, vs = stop["kept"], stop["cells"], stop["test_vs_grid"]
        print(f"\ngrid-{stop['policy']}: kept the grid's winner (or within 1% of its validation loss) on {kept} of "
              f"{cells} cells; test score against the grid's winner {min(vs):+.3f} to {max(vs):+.3f}; training rows "
              f"saved {stop['saved_mean']:.1%} on average (least {stop['saved_min']:.1%})")
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "quality-combined", "sources": sources, "headers": headers,
                                        "rows": means, "table": table, "paired_headers": diff_headers,
                                        "paired_rows": diffs, "paired_table": diff_table,
                                        "early_exit": stops}, indent=2) + "\n")
        print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
