"""A pack over two ranks (gloo, CPU): the base's layers sharded with FSDP2, each trial on one rank, the ranks in
lockstep (worker/engine/distributed.py). Its trials come out as the same pack's on one process: the same
outcomes, loss points and adapters, through a back-fill, an early stop with export, a pause and a resume from
the checkpoint, and ranks that idle while the other trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.engine import distributed_ranks
from worker.engine.distributed import assign_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available in this torch build")


def _result(out: Path, ranks: int) -> tuple[dict[str, Any], list[list[Any]], dict[str, Path], list[dict[str, Any]]]:
    outcomes: dict[str, Any] = {}
    points: list[list[Any]] = []
    adapters: dict[str, Path] = {}
    runs = []
    for rank in range(ranks):
        result = json.loads((out / f"rank{rank}.json").read_text())
        for o in result["outcomes"]:
            outcomes.setdefault(o["trial_id"], []).append(o)
            if o["adapter_dir"]:
                adapters[o["trial_id"]] = Path(o["adapter_dir"]) / "adapter_model.safetensors"
        points += result["points"]
        runs.append(result)
    return outcomes, sorted(points, key=lambda p: (p[0], p[1], p[2])), adapters, runs


def test_a_pack_over_two_ranks_trains_its_trials_exactly_as_one_process(tmp_path: Path,
                                                                        model_cache: Path) -> None:
    alone, split = tmp_path / "alone", tmp_path / "split"
    alone.mkdir()
    split.mkdir()
    distributed_ranks.run(0, 1, str(alone), "", str(model_cache))
    mp.start_processes(distributed_ranks.run, args=(2, str(split), str(tmp_path / "store"), str(model_cache)),
                       nprocs=2, start_method="spawn")
    one, one_points, one_adapters, _ = _result(alone, 1)
    two, two_points, two_adapters, ranks = _result(split, 2)
    # Each rank held half of every layer's frozen weights.
    assert [r["layer_share"] for r in ranks] == [0.5, 0.5]

    summary = {t: [(o["status"], o["steps_done"], o["best_step"]) for o in os] for t, os in one.items()}
    assert summary == {
        "a": [("completed", 10, 10)],
        "b": [("paused", 4, None), ("completed", 12, 12)],  # paused before the 5th step, resumed from step 4
        "c": [("completed", 6, 6)],
        "d": [("completed", 8, 8)],  # the back-fill
        "e": [("stopped", 6, 6)],  # stopped early at step 6, its best adapter exported
    }
    assert {t: [(o["status"], o["steps_done"], o["best_step"]) for o in os] for t, os in two.items()} == summary
    for trial_id, outcomes in one.items():
        for mine, theirs in zip(outcomes, two[trial_id], strict=True):
            if mine["best_val_loss"] is not None:
                assert theirs["best_val_loss"] == pytest.approx(mine["best_val_loss"], rel=1e-5)

    # Every loss point and every metric score, in the same places.
    assert [p[:3] for p in two_points] == [p[:3] for p in one_points]
    assert {p[0] for p in one_points if p[2] == "metric"} == {"a", "d"}
    torch.testing.assert_close([p[3] for p in two_points], [p[3] for p in one_points], rtol=1e-5, atol=1e-6)
    # The same adapters, to 1e-5.
    assert set(two_adapters) == set(one_adapters) == {"a", "b", "c", "d", "e"}
    for trial_id, path in one_adapters.items():
        mine, theirs = load_file(str(path)), load_file(str(two_adapters[trial_id]))
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(theirs[key], mine[key], rtol=1e-5, atol=1e-6)
    # Every rank saw each pack step as the whole pack's (slots and tokens over both ranks), as one process saw it:
    # what rank 0 reports to the scheduler's cost model is one unit's step.
    alone_steps = json.loads((alone / "rank0.json").read_text())["steps"]
    assert alone_steps and [r["steps"] for r in ranks] == [alone_steps, alone_steps]
    # The ranks did not have the same work: each padded some passes with idle ones.
    assert all(sum(r["idle"].values()) > 0 for r in ranks)


def test_trials_are_dealt_to_ranks_in_turn() -> None:
    assert assign_ranks(["a", "b", "c", "d", "e"], 2) == [["a", "c", "e"], ["b", "d"]]
    assert assign_ranks(["a"], 3) == [["a"], [], []]
