"""The quality benchmark's small version end to end (issue 33): `python -m benchmarks.quality.run` on the tiny model
through a real `loraplane up` (embedded default, a real worker), every arm trained, downloaded, loaded in PEFT and
scored on the test rows. The tiny random model learns nothing here: what is checked is the journey and the bookkeeping
(each arm's task, its winner, the oracle over the grid's trials), not the scores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.defaults import BEFORE
from tests.e2e.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_UNSET = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "LORAPLANE_ADMIN_TOKEN", "LORAPLANE_ARTIFACT_DIR",
                  "LORAPLANE_NAMESPACE", "LORAPLANE_API_KEY", "LORAPLANE_API_URL", "LORAPLANE_HOME")
GRID_LRS = [1e-3, 3e-3]


def test_the_small_benchmark_scores_every_arm_through_the_service(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update(LORAPLANE_BENCH_RESULTS=str(tmp_path / "results"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TMPDIR=str(tmp_path))
    command = [sys.executable, "-m", "benchmarks.quality.run", "--model", "tiny-random-llama", "--tasks", "extract",
               "--sizes", "small", "--seeds", "0", "1", "--train-rows", "16", "--test-rows", "4", "--epochs", "1",
               "--arms", "base", "default", "previous", "auto", "grid-none", "refit", "grid-alto", "oracle",
               "--grid-lr", *map(str, GRID_LRS), "--grid-rank", "4", "--grid-batch", "4",
               "--port", str(free_port()), "--timeout", "900"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    [path] = (tmp_path / "results").glob("quality-tiny-random-llama-cpu-*.json")
    result = json.loads(path.read_text())
    assert result["command"].startswith("python -m benchmarks.quality.run --model tiny-random-llama")
    assert result["complete"] is True  # written after each cell: the last write has them all
    arms = ["base", "default", "previous", "auto", "grid-none", "refit", "grid-alto", "oracle"]
    assert result["headers"] == ["task", "size", "seeds", *arms]
    assert [row[:3] for row in result["rows"]] == [["extract", "small", 2]]
    assert [(c["task"], c["seed"]) for c in result["cells"]] == [("extract", 0), ("extract", 1)]
    for cell in result["cells"]:
        assert set(cell["scores"]) == set(arms)
        assert all(0.0 <= value <= 1.0 for value in cell["scores"].values())
        winners = cell["winners"]
        # Each arm's task was the one asked for: its winner's settings say so.
        assert winners["previous"]["hyperparameters"]["target_modules"] == BEFORE["target_modules"]
        assert winners["default"]["hyperparameters"]["target_modules"] == "all-linear"
        assert winners["grid-none"]["hyperparameters"]["learning_rate"] in GRID_LRS
        # Early exit spends no more training rows than the full grid (here it may stop none: the tiny grid is short).
        assert 0 < winners["grid-alto"]["samples"] <= winners["grid-none"]["samples"]
        # The refit is the grid's winner trained again on both splits, scored as an adapter of its own.
        assert winners["refit"]["refit_of"] == winners["grid-none"]["trial_id"]
        assert winners["refit"]["trial_id"] not in winners["oracle"]["all"]
        # The oracle is the grid's trial best on the test rows (the refit is none of them): never below the grid's
        # own winner.
        assert sorted(winners["oracle"]["all"]) and len(winners["oracle"]["all"]) == len(GRID_LRS)
        assert cell["scores"]["oracle"] == max(winners["oracle"]["all"].values()) >= cell["scores"]["grid-none"]
        assert winners["grid-none"]["trial_id"] in winners["oracle"]["all"]
        # Every grid trial's validation curve is kept beside its test score (for judging selection rules later).
        curves = winners["oracle"]["val_curves"]
        assert set(curves) == set(winners["oracle"]["all"]) and all(curve for curve in curves.values())
