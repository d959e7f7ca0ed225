"""A worker keeps its loaded base models: packs of one model, one after another, load it once (PackRunner.model,
which the preload fills too; the rest of the warm models: tests/worker/test_model_cache.py). Real packs of the tiny
model train on the CPU; the bus is a file."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import worker.pack_runner
from common.artifacts import LocalArtifactStore
from common.bus import SCHEDULER_STREAM, FileBus
from common.messages import ModelSourceFields, PackMessage, TrialPayload
from common.metrics import PREFERENCE_METRICS, PREFERENCE_SPLITS
from worker.engine import Evaluation, ModelSource, NoScore
from worker.engine import dpo as dpo_module
from worker.engine.spec import DpoObjective
from worker.heartbeat import Heartbeat, Incarnation
from worker.model_cache import model_source, preload_models
from worker.pack_runner import PackRunner

TINY = {"name": "tiny-random-llama", "kind": "tiny-random-llama", "path": None, "package": None, "gguf_file": None}


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every real load of a base model the runner makes, by name."""
    calls: list[str] = []
    real = worker.pack_runner.load_base_model

    def counting(source: ModelSource, **kwargs: Any) -> Any:
        calls.append(source.name)
        return real(source, **kwargs)

    monkeypatch.setattr(worker.pack_runner, "load_base_model", counting)
    return calls


@pytest.fixture
def runner(tmp_path: Path, model_cache: Path) -> PackRunner:
    bus = FileBus(tmp_path / "bus.db")
    store = LocalArtifactStore(tmp_path / "artifacts")
    rows = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(8)]
    store.put_bytes("files/data.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    heartbeat = Heartbeat(bus, 1.0, {"worker_id": "w", "queue": "q"}, Incarnation())
    return PackRunner(worker_id="w", device=torch.device("cpu"), bus=bus, store=store, model_cache_dir=model_cache,
                      heartbeat=heartbeat, report_timeout_s=5.0)


@pytest.fixture
def model_cache() -> Path:
    from tests.conftest import MODEL_CACHE

    return MODEL_CACHE


def pack(pack_id: str, source: dict[str, Any] = TINY) -> PackMessage:
    trial = TrialPayload(
        trial_id=f"{pack_id}-t0", task_id="task", total_steps=2, max_seq_len=32, eval_interval=2,
        hyperparameters={"learning_rate": 1e-3, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                         "batch_size": 2, "target_modules": ["q_proj"], "seed": 0},
        training_file_key="files/data.jsonl", validation_file_key=None, validation_split=0.25,
        split_seed=0, training={},
    )
    return PackMessage(pack_id=pack_id, worker_id="w", base_model=ModelSourceFields(**source), trials=[trial])


def ends(runner: PackRunner) -> list[tuple[str, str]]:
    messages = [m for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]
    return [(m["pack_id"], m["type"]) for m in messages if m["type"] in ("pack.finished", "pack.failed")]


def test_two_packs_of_one_model_load_it_once(runner: PackRunner, loads: list[str]) -> None:
    runner.run(pack("pack-1"))
    runner.run(pack("pack-2"))
    assert ends(runner) == [("pack-1", "pack.finished"), ("pack-2", "pack.finished")]
    assert loads == ["tiny-random-llama"]


def test_a_preloaded_model_is_not_loaded_again_by_its_first_pack(runner: PackRunner, loads: list[str]) -> None:
    preload_models(runner.model, "tiny-random-llama")
    runner.run(pack("pack-1"))
    assert ends(runner) == [("pack-1", "pack.finished")]
    assert loads == ["tiny-random-llama"]


def test_a_model_whose_registry_entry_changed_is_loaded_again(runner: PackRunner, loads: list[str],
                                                               tmp_path: Path) -> None:
    first = runner.model(model_source(TINY)).model
    assert runner.model(model_source(TINY)).model is first
    moved = model_source({**TINY, "path": str(tmp_path / "elsewhere")})  # PATCHed: another source, same name
    assert runner.model(moved).model is not first
    assert runner.model(moved).model is runner.model(moved).model
    assert loads == ["tiny-random-llama", "tiny-random-llama"]


@pytest.mark.parametrize(("training", "warmup", "schedule"), [
    ({"lr_schedule": "cosine", "warmup_steps": None}, 4, "cosine"),  # the default: 3% of 120 steps, rounded up
    ({"lr_schedule": "constant", "warmup_steps": 0}, 0, "constant"),  # a task stored before these defaults
    ({"lr_schedule": "linear", "warmup_steps": 7}, 7, "linear"),
    ({}, 4, "cosine"),
])
def test_a_trials_warm_up_and_schedule_come_from_its_task_or_the_defaults(
    runner: PackRunner, training: dict[str, Any], warmup: int, schedule: str
) -> None:
    trial = pack("p").trials[0].model_copy(update={"total_steps": 120, "training": training})
    spec = runner.trial_spec(trial, lambda key: [json.loads(line) for line in runner.store.get_bytes(key).splitlines()])
    assert (spec.warmup_steps, spec.lr_schedule, spec.max_steps) == (warmup, schedule, 120)


@pytest.mark.parametrize("validation", [{"validation_split": 0.25}, {"validation_file_key": "files/val.jsonl",
                                                                       "validation_split": None}])
def test_a_refit_trains_on_the_training_and_validation_rows_and_validates_on_none(
    validation: dict[str, Any]
) -> None:
    """Issue 33's refit: the trial's rows are the training rows and the validation rows (split off or a file's)."""
    files = {"files/data.jsonl": [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(8)],
             "files/val.jsonl": [{"prompt": f"v{i}", "completion": f"b{i}"} for i in range(3)]}
    searched = pack("p").trials[0].model_copy(update=validation)
    refit = searched.model_copy(update={"refit": True})
    before = PackRunner.trial_spec(searched, files.__getitem__)
    after = PackRunner.trial_spec(refit, files.__getitem__)
    assert before.val_rows and after.val_rows == []
    assert sorted(map(str, after.train_rows)) == sorted(map(str, before.train_rows + before.val_rows))


def test_a_dpo_trials_objective_has_its_own_beta_and_its_tasks_loss() -> None:
    files = {"files/data.jsonl": [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(8)]}
    trial = pack("p").trials[0]
    hyperparameters = {**trial.hyperparameters, "beta": 0.25}
    dpo = trial.model_copy(update={"hyperparameters": hyperparameters, "evaluation": {"metric": "reward_accuracy"},
                                   "objective": {"type": "dpo", "loss": "ipo", "label_smoothing": 0.0}})
    spec = PackRunner.trial_spec(dpo, files.__getitem__)
    assert spec.dpo == DpoObjective(beta=0.25, loss="ipo", label_smoothing=0.0)
    assert spec.evaluation is not None and spec.evaluation.metric == "reward_accuracy"
    assert PackRunner.trial_spec(trial, files.__getitem__).dpo is None  # an SFT trial (no objective sent)
    # The points a DPO trial reports are the ones the service stores and shows.
    assert dpo_module.PREFERENCE_SPLITS == PREFERENCE_SPLITS and dpo_module.REWARD_ACCURACY in PREFERENCE_METRICS


def _metric_points(messages: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Every "metric" point the pack reported, by trial (in its points reports)."""
    scores: dict[str, list[float]] = {}
    for message in messages:
        for trial_id, _step, split, value in message.get("points") or []:
            if split == "metric" and message["type"] == "points":
                scores.setdefault(trial_id, []).append(value)
    return scores


@pytest.mark.parametrize("stored", [
    {"metric": "regex", "max_new_tokens": 4, "pattern": "a{1000000000}"},  # the patterns
    {"metric": "regex", "max_new_tokens": 4, "pattern": "(?:a{60000}){60000}"},
    {"metric": "regex", "max_new_tokens": 4, "pattern": "(" * 5000 + ")" * 5000},
    {"metric": "regex", "max_new_tokens": 4},  # no pattern at all
])
def test_a_stored_pattern_the_policy_refuses_is_never_compiled(stored: dict[str, Any],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # A task row written before common/regex_policy.py existed: the worker scores it by nothing (and says why).
    assert worker.pack_runner.evaluation_of(stored, "t-1") is None
    assert "t-1: its regex metric's pattern is refused" in caplog.text
    allowed = worker.pack_runner.evaluation_of({**stored, "pattern": r"\d+"}, "t-2")
    assert allowed is not None and allowed.pattern == r"\d+"


def test_the_scorer_turns_a_pattern_refused_when_compiled_into_no_score() -> None:
    # What train_pack hears for a pattern that reaches the scorer and the policy refuses: NoScore (no metric point).
    with pytest.raises(NoScore, match="its pattern is refused"):
        worker.pack_runner.score_metric(Evaluation(metric="regex", pattern="a{1000001}"), ["a"], [""])
    assert worker.pack_runner.score_metric(Evaluation(metric="regex", pattern=r"\d"), ["a1", "b"], ["", ""]) == 0.5


def test_a_pack_with_a_refused_pattern_finishes_and_scores_only_the_allowed_trial(runner: PackRunner) -> None:
    # Refused (a count over 1000); compiling it anyway would cost `regex` ~260 MB and report a score.
    first = pack("pack-1").trials[0]
    refused = first.model_copy(update={"trial_id": "refused", "evaluation": {"metric": "regex", "max_new_tokens": 4,
                                                                             "pattern": "a{1000001}"}})
    allowed = first.model_copy(update={"trial_id": "allowed", "evaluation": {"metric": "regex", "max_new_tokens": 4,
                                                                             "pattern": ".*"}})
    runner.run(pack("pack-1").model_copy(update={"trials": [refused, allowed]}))
    messages = [m for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]
    assert [m["type"] for m in messages if m["type"].startswith("pack.")][-1] == "pack.finished"
    assert {m["trial_id"] for m in messages if m["type"] == "trial.finished"} == {"refused", "allowed"}
    assert _metric_points(messages) == {"allowed": [1.0]}  # ".*" matches every answer; none for the refused


def test_trials_that_end_together_store_their_adapters_side_by_side(runner: PackRunner) -> None:
    """Two trials that end at the same step: their adapters are stored at once, each reported after its own (the
    store lets neither finish until both are under way; stored one after the other, the pack would fail)."""
    both_under_way = threading.Barrier(2, timeout=60)
    real_put = runner.store.put_file

    def put_file(key: str, path: Path) -> None:
        if key.startswith("adapters/"):
            both_under_way.wait()
        real_put(key, path)

    runner.store.put_file = put_file  # type: ignore[method-assign]
    first = pack("pack-1").trials[0]
    second = first.model_copy(update={"trial_id": "pack-1-t1"})
    runner.run(pack("pack-1").model_copy(update={"trials": [first, second]}))
    messages = [m for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]
    assert [m["type"] for m in messages if m["type"].startswith("pack.")][-1] == "pack.finished"
    finished = {m["trial_id"]: m["adapter_key"] for m in messages if m["type"] == "trial.finished"}
    assert set(finished) == {"pack-1-t0", "pack-1-t1"}
    assert all(key and runner.store.exists(key) for key in finished.values())


@pytest.mark.parametrize("epochs_kept", [None, 0])
def test_a_trial_stores_its_checkpoints_and_drops_those_it_no_longer_keeps(runner: PackRunner,
                                                                           epochs_kept: int | None) -> None:
    """6 training rows at 2 a step: epochs end at steps 3 and 6; validated at 2, 4 and 6. What the store holds at the
    end is what the reports leave kept: the best, the last, and the epoch ends unless ``epoch_checkpoints`` is 0."""
    first = pack("pack-1").trials[0]
    training = {"checkpoints": True, "epoch_checkpoints": epochs_kept}
    trial = first.model_copy(update={"total_steps": 6, "training": training,
                                     "hyperparameters": {**first.hyperparameters, "learning_rate": 0.5}})
    runner.run(pack("pack-1").model_copy(update={"trials": [trial]}))
    messages = [m for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]
    saved = [m for m in messages if m["type"] == "trial.checkpoint_saved"]
    types = [m["type"] for m in messages if m["type"] in ("trial.checkpoint_saved", "trial.finished")]
    assert types[-1] == "trial.finished" and len(saved) == len(types) - 1
    assert {3, 6} <= {m["step"] for m in saved} <= {2, 3, 4, 6}
    kept: dict[int, dict[str, Any]] = {}
    for m in saved:
        assert m["epoch"] == round(m["step"] / 3, 4) and m["epoch_end"] == (m["step"] % 3 == 0) and m["size_bytes"] > 0
        kept[m["step"]] = m
        for step in m["dropped_steps"]:
            kept.pop(step)
    stored = runner.store.keys(f"adapter-checkpoints/task/{trial.trial_id}")
    assert stored == sorted(m["adapter_key"] for m in kept.values())
    assert all((m["val_loss"] is None) == (m["step"] % 2 == 1) for m in saved)  # only step 3 is not validated
    losses = {step: m["val_loss"] for step, m in kept.items() if m["val_loss"] is not None}
    best = min(losses, key=lambda s: losses[s])
    want = {best, 6} | ({3, 6} if epochs_kept is None else set())
    assert set(kept) == want


def test_a_trial_without_checkpoints_stores_none(runner: PackRunner) -> None:
    """Checkpoints are asked for (`training.checkpoints`); a trial that does not ask exports none."""
    first = pack("pack-1").trials[0]
    trial = first.model_copy(update={"total_steps": 6})
    runner.run(pack("pack-1").model_copy(update={"trials": [trial]}))
    messages = [m for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)]
    assert "trial.finished" in {m["type"] for m in messages}
    assert not [m for m in messages if m["type"] == "trial.checkpoint_saved"]
    assert runner.store.keys(f"adapter-checkpoints/task/{trial.trial_id}") == []
