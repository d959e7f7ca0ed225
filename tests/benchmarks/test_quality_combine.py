"""benchmarks/quality/combine.py: parts of the quality matrix, run in different sessions, as one table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.quality.combine import merge, tables


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
