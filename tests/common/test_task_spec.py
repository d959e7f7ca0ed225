"""common/task_spec.py: the one parser of a task's stored spec, and the defaults of fields an older row lacks."""

from __future__ import annotations

from typing import Any

from common.metrics import DEFAULT_MAX_NEW_TOKENS
from common.settings import DEFAULT_MAX_TRIALS_PER_PACK
from common.task_spec import DEFAULT_MAX_SEQ_LEN, Evaluation, Scheduling, TaskSpec

# The fields every stored spec has had since the first migration.
OLDEST: dict[str, Any] = {"base_model": "m", "training_file": "file-1", "strategy": "grid", "search_space": {},
                          "max_seq_len": 128, "eval_interval": 5, "early_exit": {"policy": "none"}, "seed": 3,
                          "scheduling": {"max_trials_per_pack": 4}}


def test_metric_of_a_stored_spec() -> None:
    assert TaskSpec.from_stored(OLDEST).metric == "loss"  # a task stored before evaluation existed
    assert TaskSpec.from_stored({**OLDEST, "evaluation": None}).metric == "loss"
    contains = {"metric": "contains", "max_new_tokens": 8, "pattern": None}
    assert TaskSpec.from_stored({**OLDEST, "evaluation": contains}).metric == "contains"


def test_an_older_row_takes_each_default_from_one_place() -> None:
    bare = {"base_model": "m", "training_file": "file-1", "eval_interval": 5}
    spec = TaskSpec.from_stored(bare)
    assert spec.max_seq_len == DEFAULT_MAX_SEQ_LEN and spec.seed == 0 and spec.strategy == "grid"
    assert spec.scheduling == Scheduling(DEFAULT_MAX_TRIALS_PER_PACK)
    assert spec.evaluation is None and spec.metric == "loss"  # the worker is sent None, as before
    assert spec.early_exit == {"policy": "none"} and spec.training == {}
    assert spec.validation_file is None and spec.validation_split is None and spec.max_steps is None
    assert not spec.refit and spec.training_rows is None and spec.validation_rows is None  # before refits


def test_a_stored_spec_round_trips() -> None:
    full = {**OLDEST, "validation_file": None, "validation_split": 0.1, "max_trials": None, "epochs": 2,
            "max_steps": None, "training": {"lr_schedule": "cosine", "warmup_steps": None},
            "evaluation": {"metric": "regex", "max_new_tokens": 16, "pattern": "^a"},
            "early_exit": {"policy": "alto", "warmup_ratio": 0.1},
            "refit": True, "training_rows": 900, "validation_rows": 100}
    spec = TaskSpec.from_stored(full)
    assert spec.to_stored() == full
    assert TaskSpec.from_stored(spec.to_stored()) == spec
    assert (spec.max_seq_len, spec.seed, spec.scheduling.max_trials_per_pack, spec.metric) == (128, 3, 4, "regex")


def test_a_partial_scheduling_or_evaluation_keeps_the_other_defaults() -> None:
    spec = TaskSpec.from_stored({**OLDEST, "scheduling": {}, "evaluation": {"metric": "exact_match"}})
    assert spec.scheduling.max_trials_per_pack == DEFAULT_MAX_TRIALS_PER_PACK
    assert spec.evaluation == Evaluation("exact_match", DEFAULT_MAX_NEW_TOKENS, None)


def test_a_task_row_parses_its_spec_once_and_again_when_it_is_replaced() -> None:
    from common.tables import Task

    task = Task(id="task-1", base_model="m", training_file_id="file-1", spec=dict(OLDEST))
    first = task.parsed_spec
    assert task.parsed_spec is first and first.max_seq_len == 128
    task.spec = {**OLDEST, "max_seq_len": 256}
    assert task.parsed_spec is not first and task.parsed_spec.max_seq_len == 256
