"""Replaying logged sweeps: metrics on small synthetic sweeps whose answers are known, the file format's
errors, and `loraplane replay` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loraplane.cli import main
from scheduler.early_exit.config import EarlyExitConfig
from scheduler.sim.replay import CurvesFormatError, parse_rows, read_curves, replay, spearman

ROOT = Path(__file__).resolve().parents[2]
ALTO = EarlyExitConfig(policy="alto", rungs=1, keep_ratio=0.25)  # ALTO's own single cut to a quarter
SWEEPS = ROOT / "benchmarks" / "results" / "sweeps"


def row(tid: str, loss: Callable[[int], float], *, total: int = 100, bs: int = 2, every: int = 5,
        train_loss: Callable[[int], float] | None = None) -> dict[str, Any]:
    """A full curve: a train point every step, a val point every `every` steps; 10 tokens a row."""
    def point(s: int, value: float) -> list[Any]:
        return [s, s * bs, s * bs * 10, value]
    train_loss = train_loss or loss
    return {"trial_id": tid, "hyperparameters": {"learning_rate": 1e-4, "batch_size": bs}, "samples_per_step": bs,
            "tokens_per_step": bs * 10, "total_steps": total,
            "train": [point(s, train_loss(s)) for s in range(1, total + 1)],
            "val": [point(s, loss(s)) for s in range(every, total + 1, every)]}


def sweep_of(rows: list[dict[str, Any]]) -> list:
    return parse_rows(json.dumps(r) for r in rows)


def falling(start: float, rate: float = 0.005) -> Callable[[int], float]:
    return lambda s: start - rate * s


def eight(late_bloomer: bool = False) -> list[dict[str, Any]]:
    """8 trials of 100 steps (warm-up boundary: step 5), straight falling curves 0.25 apart; no trial diverges
    or overfits (train = val, the EMA lags above both)."""
    rows = [row(f"t{i}", falling(2 + 0.25 * i)) for i in range(8)]
    if late_bloomer:  # worst at the boundary, best at the end
        rows[7] = row("t7", falling(3.75, rate=0.03))
    return rows


def test_alto_cuts_to_a_quarter_at_the_boundary_and_keeps_the_best() -> None:
    result = replay(ALTO, sweep_of(eight()))
    # 6 cut at step 5 (10 samples each), 2 train all 100 steps (200 samples each), of 8 x 200.
    assert result.samples_trained == 6 * 10 + 2 * 200
    assert result.samples_saved_frac == pytest.approx(1 - 460 / 1600)
    assert {o.trial_id: (o.stopped_at, o.reason) for o in result.outcomes if o.reason} == {
        f"t{i}": (5, "underperforming") for i in range(2, 8)}
    assert (result.best_trial, result.best_kept, result.best_val_ratio) == ("t0", True, 1.0)
    assert result.spearman_warmup == pytest.approx(1.0)


def test_the_default_cuts_twice_gently_at_five_and_ten_percent() -> None:
    result = replay(EarlyExitConfig(policy="alto"), sweep_of(eight()))
    # Rung 1 (step 5) keeps ceil(0.45 x 8) = 4; rung 2 (step 10) keeps ceil(0.45 x 4) = 2. t4..t7 are charged
    # 5 steps, t2 and t3 10 steps, t0 and t1 all 100 (2 samples a step).
    assert {o.trial_id: (o.stopped_at, o.reason) for o in result.outcomes if o.reason} == {
        **{f"t{i}": (5, "underperforming") for i in range(4, 8)}, "t2": (10, "underperforming"),
        "t3": (10, "underperforming")}
    assert result.samples_trained == 4 * 10 + 2 * 20 + 2 * 200
    assert (result.best_trial, result.best_kept, result.best_val_ratio) == ("t0", True, 1.0)


@pytest.mark.parametrize("name", ["trivia", "arithmetic", "trivia-seed1", "arithmetic-seed1"])
def test_the_defaults_keep_the_best_and_save_most_of_every_committed_sweep(name: str) -> None:
    """The bar the defaults were set by (issue 17), on the committed full sweeps: the two they were chosen on and
    two of new data and seeds (benchmarks/results/sweeps/SUMMARY.md)."""
    dataset, _, seed = name.partition("-")
    sweep = read_curves(SWEEPS / f"{dataset}-smollm2-full{'-' + seed if seed else ''}.jsonl")
    result = replay(EarlyExitConfig(policy="alto"), sweep)
    assert result.samples_saved_frac >= 0.70 and result.best_kept
    assert result.best_val_ratio is not None and result.best_val_ratio <= 1.01


@pytest.mark.parametrize(("name", "best_kept"), [
    ("trivia-smollm2-full-rerun", True), ("arithmetic-smollm2-full-rerun", False),
    ("trivia-smollm2-full-seed2", False), ("arithmetic-smollm2-full-seed2", True),
])
def test_on_the_later_sweeps_the_defaults_save_most_and_stay_within_one_percent_of_the_best(
    name: str, best_kept: bool
) -> None:
    """The issue-6 grids rerun on today's engine (new numerics), and a third seed run after the defaults were fixed:
    the defaults save >= 70% and reach a validation loss within 1.01 of the best, but on two of the four the best
    trial itself is cut (arithmetic's rerun 1.0098, trivia's seed 2 1.0079; docs/early-exit.md)."""
    result = replay(EarlyExitConfig(policy="alto"), read_curves(SWEEPS / f"{name}.jsonl"))
    assert result.samples_saved_frac >= 0.70
    assert result.best_val_ratio is not None and result.best_val_ratio <= 1.01
    assert result.best_kept is best_kept


def test_a_late_bloomer_cut_at_the_boundary_is_reported_lost() -> None:
    result = replay(ALTO, sweep_of(eight(late_bloomer=True)))
    assert (result.best_trial, result.best_kept) == ("t7", False)
    assert result.best_val_ratio == pytest.approx(1.5 / 0.75)  # t0 ends at 1.5; t7 would have reached 0.75
    # Boundary ranks 1..8; final ranks: t7 first, the others one lower: sum d^2 = 7 + 49.
    assert result.spearman_warmup == pytest.approx(1 - 6 * 56 / (8 * 63))


def test_an_overfitting_stop_keeps_the_best_trial_even_before_its_best_point() -> None:
    # Val creeps down but stays far above the train loss: overfitting at the second evaluation (step 20).
    rows = [row("a", falling(2.0, rate=0.001), every=10, train_loss=lambda s: 1.0)]
    result = replay(ALTO, sweep_of(rows))
    [outcome] = result.outcomes
    assert (outcome.stopped_at, outcome.reason, outcome.samples_trained) == (20, "overfitting", 40)
    assert result.best_kept is True
    assert result.best_val_ratio == pytest.approx(1.98 / 1.9)
    assert result.spearman_warmup is None  # one trial


def test_none_saves_nothing_and_keeps_everything() -> None:
    result = replay(EarlyExitConfig(policy="none"), sweep_of(eight(late_bloomer=True)))
    assert result.summary() == {"policy": "none", "trials": 8, "samples_saved_frac": 0.0, "best_kept": True,
                                "best_val_ratio": 1.0, "spearman_warmup": pytest.approx(1 - 6 * 56 / (8 * 63))}


def test_asha_stops_three_of_four_at_the_first_rung() -> None:
    # Budget 64 steps x 10 tokens = 640: rungs at 10, 40 and 160 tokens, i.e. steps 1, 4 and 16.
    rows = [row(f"t{i}", lambda s, i=i: 1 + i / 4, total=64, bs=1, every=1) for i in range(4)]
    result = replay(EarlyExitConfig(policy="asha"), sweep_of(rows))
    assert {o.trial_id: (o.stopped_at, o.reason) for o in result.outcomes if o.reason} == {
        "t1": (1, "asha"), "t2": (1, "asha"), "t3": (1, "asha")}
    assert result.samples_saved_frac == pytest.approx(1 - 67 / 256)
    assert result.best_kept is True


def test_a_stopped_trial_is_charged_up_to_its_stop_on_a_sparse_curve() -> None:
    rows = eight()
    for r in rows:  # train points only every 4th step: samples between points are step x batch
        r["train"] = r["train"][3::4]
    result = replay(ALTO, sweep_of(rows))
    assert result.samples_trained == 6 * 10 + 2 * 200


def test_a_trial_held_at_its_boundary_pauses_until_the_ranking_and_then_resumes_its_curve() -> None:
    """Short trials reach their boundary first and wait there (their slot given up), charged nothing while
    they wait: the cut ones pay only up to their boundary, the kept ones train their whole curve."""
    # Two of 40 steps (boundary 2, val every 2 steps) and six of 200 (boundary 10, val every 10).
    rows = [row(f"s{i}", falling(2 + 0.25 * i), total=40, every=2) for i in range(2)]
    rows += [row(f"l{i}", falling(2.1 + 0.25 * i), total=200, every=10) for i in range(6)]
    result = replay(ALTO, sweep_of(rows))
    outcomes = {o.trial_id: o for o in result.outcomes}
    # Boundary losses: s0 1.99, l0 2.05, s1 2.24, l1 2.30, ...: keep ceil(0.25 x 8) = 2: s0 and l0.
    assert {t for t, o in outcomes.items() if o.reason is None} == {"s0", "l0"}
    assert (outcomes["s1"].stopped_at, outcomes["s1"].samples_trained) == (2, 4)  # not the 10 steps it waited
    assert all((outcomes[f"l{i}"].stopped_at, outcomes[f"l{i}"].samples_trained) == (10, 20) for i in range(1, 6))
    assert outcomes["s0"].samples_trained == 80 and outcomes["l0"].samples_trained == 400
    assert result.samples_trained == 80 + 400 + 4 + 5 * 20
    assert (result.best_trial, result.best_kept, result.best_val_ratio) == ("l0", True, 1.0)


def test_spearman() -> None:
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)  # tied ranks share 1.5
    assert spearman([1, 1], [1, 2]) is None and spearman([1], [1]) is None


# ---- the file format -----------------------------------------------------------------------------------


def good(**changes: Any) -> str:
    r = {"trial_id": "a", "samples_per_step": 2, "tokens_per_step": 20, "total_steps": 10,
         "train": [[1, 2, 20, 2.0]], "val": [[5, 10, 100, 1.5]]}
    r.update(changes)
    return json.dumps(r)


@pytest.mark.parametrize(("line", "why"), [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "a row must be a JSON object"),
    (good(trial_id=""), "'trial_id' must be a non-empty string"),
    (good(total_steps=0), "'total_steps' must be >= 1"),
    (good(samples_per_step=2.5), "'samples_per_step' must be an integer"),
    (good(train=[[1, 2, 20]]), "train[0] must be [step, samples, tokens, loss]"),
    (good(val=[[5, 10, 100, "low"]]), "val[0]: loss must be a number or null"),
    (good(val=[[11, 22, 220, 1.0]]), "val[0]: step 11 is past total_steps 10"),
    (good(train=[[2, 4, 40, 1.0], [1, 2, 20, 1.0]]), "train[1]: step 1 does not follow step 2"),
    (good(train=[[-1, 0, 0, 1.0]]), "train[0]: step must be an integer >= 0"),
    (good(val={"step": 1}), "'val' must be a list"),
    (good(hyperparameters=[1]), "'hyperparameters' must be an object"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply to read"),  # json.loads's RecursionError, not a traceback
])
def test_a_bad_row_names_its_line_and_why(line: str, why: str) -> None:
    with pytest.raises(CurvesFormatError) as err:
        parse_rows([good(trial_id="first"), "", line])
    assert err.value.line == 3
    assert why in err.value.message


def test_duplicate_ids_and_empty_files_are_refused() -> None:
    with pytest.raises(CurvesFormatError, match="line 2: trial_id 'a' appears twice"):
        parse_rows([good(), good()])
    with pytest.raises(CurvesFormatError, match="no trials"):
        parse_rows(["", "  "])


def test_null_losses_are_non_finite_and_extra_keys_are_ignored() -> None:
    [trial] = parse_rows([good(val=[[5, 10, 100, None]], task_id="task-1", state="completed")])
    assert math.isnan(trial.curves.val[0].loss)
    assert trial.curves.state == "running"  # replay sets the state itself


# ---- the command ------------------------------------------------------------------------------------------


def write(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "curves.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_json_is_one_object_with_the_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, eight())
    main(["replay", str(path), "--policy", "alto", "--param", "rungs=1", "--param", "keep_ratio=0.25", "--json"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    summary = json.loads(out)
    assert summary == {"policy": "alto", "trials": 8, "samples_saved_frac": pytest.approx(1 - 460 / 1600),
                       "best_kept": True, "best_val_ratio": 1.0, "spearman_warmup": pytest.approx(1.0)}
    assert summary == replay(ALTO, read_curves(path)).summary()


def test_cli_table_and_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, eight())
    main(["replay", str(path), "--policy", "alto", "--param", "rungs=1", "--param", "keep_ratio=0.5"])
    out = capsys.readouterr().out
    assert "samples saved       47.5% (760 of 1,600)" in out  # keep 4: 4 x 10 + 4 x 200 trained
    assert "underperforming 4" in out and "t7" in out


def test_cli_refuses_a_malformed_file_with_one_line_and_a_failing_exit(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(good(trial_id="x") + "\n\n" + good(total_steps="ten") + "\n")
    proc = subprocess.run([sys.executable, "-m", "loraplane.cli", "replay", str(path), "--json"], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"loraplane replay: {path}:3: 'total_steps' must be an integer, got \"ten\""]


def test_cli_refuses_a_parameter_of_another_policy(tmp_path: Path) -> None:
    path = write(tmp_path, eight())
    with pytest.raises(SystemExit, match="warmup_ratio: not a parameter of the 'asha' policy"):
        main(["replay", str(path), "--policy", "asha", "--param", "warmup_ratio=0.1"])
