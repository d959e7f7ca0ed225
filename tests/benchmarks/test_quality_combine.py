"""benchmarks/quality/combine.py: parts of the quality matrix, run in different sessions, as one table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.quality.combine import early_exit, merge, tables


def part(path: Path, cells: list[dict[str, Any]], commit: str) -> Path:
    path.write_text(json.dumps({"date": "2026-11-27", "device": "NVIDIA H200", "commit": commit, "command": "c",
                                "complete": True, "cells": cells}))
    return path


def cell(seed: int, default: float, auto: float) -> dict[str, Any]:
    return {"task": "rewrite", "size": "small", "seed": seed, "scores": {"default": default, "auto": auto}}


def test_parts_add_up_to_one_table_with_paired_differences(tmp_path: Path) -> None:
    a = part(tmp_path / "a.json", [cell(0, 0.70, 0.85)], "aaa")
    b = part(tmp_path / "b.json", [cell(2, 0.75, 0.84), cell(1, 0.76, 0.87)], "bbb")
    cells, sources = merge([a, b])
    assert [c["seed"] for c in cells] == [0, 1, 2]
    assert [(s["file"], s["commit"], s["cells"]) for s in sources] == [("a.json", "aaa", 1), ("b.json", "bbb", 2)]
    headers, means, _, diffs = tables(cells)
    assert headers == ["task", "size", "seeds", "default", "auto"]
    assert means[0][:4] == ["rewrite", "small", 3, "0.737 ±0.080"]
    against_default = next(r for r in diffs if r[2] == "- default")
    assert against_default[3] == "" and against_default[4].startswith("+0.117 ±")  # (0.15 + 0.11 + 0.09) / 3


def test_the_same_cell_in_two_parts_is_refused(tmp_path: Path) -> None:
    a = part(tmp_path / "a.json", [cell(0, 0.7, 0.8)], "aaa")
    b = part(tmp_path / "b.json", [cell(0, 0.7, 0.8)], "bbb")
    with pytest.raises(ValueError, match="in two files"):
        merge([a, b])


def test_early_exit_is_judged_against_the_full_grid_of_the_same_cell() -> None:
    def grid_cell(alto: dict[str, Any], alto_score: float) -> dict[str, Any]:
        full = {"hyperparameters": {"learning_rate": 1e-3}, "best_val_loss": 1.00, "samples": 1000}
        return {"task": "add", "size": "small", "seed": 0, "scores": {"grid-none": 0.9, "grid-alto": alto_score},
                "winners": {"grid-none": full, "grid-alto": alto}}

    same = {"hyperparameters": {"learning_rate": 1e-3}, "best_val_loss": 1.00, "samples": 300}
    near = {"hyperparameters": {"learning_rate": 3e-4}, "best_val_loss": 1.005, "samples": 250}  # within 1%
    worse = {"hyperparameters": {"learning_rate": 1e-4}, "best_val_loss": 1.05, "samples": 200}
    cells = [grid_cell(same, 0.9), grid_cell(near, 0.88), grid_cell(worse, 0.8),
             {"task": "add", "size": "small", "seed": 3, "scores": {"base": 0.0}, "winners": {}}]  # not trained
    stop = early_exit(cells, "alto")
    assert (stop["cells"], stop["kept"]) == (3, 2)
    assert stop["test_vs_grid"] == [0.0, -0.02, -0.1]
    assert stop["saved_mean"] == pytest.approx(0.75) and stop["saved_min"] == pytest.approx(0.7)
    assert early_exit(cells, "asha")["cells"] == 0
