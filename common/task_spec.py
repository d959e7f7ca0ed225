"""A task's stored spec, typed (no torch, no I/O).

The API validates a submission (api/schemas/tasks.py), fills every default in and stores the result as JSON in
`tasks.spec` (`TaskSpec.to_stored`). Everything after it — the scheduler's planner, dispatch and early-exit
shell, the API's views and curves — reads it through `TaskSpec.from_stored`, the one parser, which is also the one
place that says what a field left out of an older task's row means. Each default here is the default: the
request schema takes its defaults from these constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.metrics import DEFAULT_MAX_NEW_TOKENS, DEFAULT_METRIC
from common.settings import DEFAULT_MAX_TRIALS_PER_PACK

DEFAULT_MAX_SEQ_LEN = 512
DEFAULT_SEED = 0
DEFAULT_STRATEGY = "grid"
NO_EARLY_EXIT: Mapping[str, Any] = {"policy": "none"}


@dataclass(frozen=True)
class Scheduling:
    # The most trials of this task that share one pack (a worker's slot cap may lower it).
    max_trials_per_pack: int = DEFAULT_MAX_TRIALS_PER_PACK


@dataclass(frozen=True)
class Evaluation:
    """How the task's trials are judged (common/metrics.py): "loss", or a generative metric the worker scores."""

    metric: str = DEFAULT_METRIC
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    pattern: str | None = None  # the regex metric's

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "max_new_tokens": self.max_new_tokens, "pattern": self.pattern}


LOSS = Evaluation()  # judged by the validation loss: every default


@dataclass(frozen=True)
class Objective:
    """What the task's trials minimise: "sft", the next-token loss of the answers, or "dpo", Direct Preference
    Optimisation on preference rows (worker/engine/dpo.py), its beta a dimension of the search space."""

    type: str = "sft"  # "sft" | "dpo"
    loss: str = "sigmoid"  # a DPO task's: "sigmoid" (the DPO paper's) | "ipo"
    label_smoothing: float = 0.0  # a DPO task's sigmoid loss's

    @property
    def dpo(self) -> bool:
        return self.type == "dpo"

    def as_dict(self) -> dict[str, Any]:
        if not self.dpo:
            return {"type": self.type}
        return {"type": self.type, "loss": self.loss, "label_smoothing": self.label_smoothing}


SFT = Objective()


@dataclass(frozen=True)
class TaskSpec:
    base_model: str
    training_file: str
    validation_file: str | None
    validation_split: float | None  # None: a validation file, or none at all
    strategy: str  # "grid" | "random"
    search_space: dict[str, Any]  # the normalised space (common/search_space.py), as stored
    max_trials: int | None
    epochs: int | None
    max_steps: int | None
    max_seq_len: int
    eval_interval: int  # resolved at submission: a tenth of the longest trial's steps unless given
    # The policy and all of its parameters, as stored; `scheduler.early_exit.config.from_spec` parses it (the
    # scheduler's own type: this package imports nothing of the scheduler).
    early_exit: Mapping[str, Any] = field(default_factory=lambda: dict(NO_EARLY_EXIT))
    seed: int = DEFAULT_SEED
    # How every trial trains (lr schedule, warm-up, weight decay, clipping, rsLoRA), passed to the worker as
    # stored; a task stored before `training` existed has none, which the worker reads as its old defaults.
    training: Mapping[str, Any] = field(default_factory=dict)
    scheduling: Scheduling = field(default_factory=Scheduling)
    # None: a task stored before `evaluation` existed, judged by its loss (as a new one is by default); the
    # worker is sent None for it, as before.
    evaluation: Evaluation | None = field(default_factory=Evaluation)
    # The submitter's own label and string pairs (OpenAI's `suffix` and `metadata`): kept and returned, not read.
    suffix: str | None = None
    metadata: Mapping[str, str] | None = None
    # Train the winning configuration again on the training and validation rows once the search ends, as an
    # adapter of its own (`refit_steps`); the rows each split had at submission size it. None: a task stored
    # before the counts were kept (it cannot have asked for a refit).
    refit: bool = False
    training_rows: int | None = None
    validation_rows: int | None = None
    # The experiment trackers its trials are logged to, as shown (`type`, `tracking_uri`, `experiment`, `token_set`);
    # their tokens are kept encrypted in the `trackers` table only.
    integrations: tuple[Mapping[str, Any], ...] = ()
    objective: Objective = SFT  # a task stored before objectives existed: SFT

    @property
    def metric(self) -> str:
        return (self.evaluation or LOSS).metric

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> TaskSpec:
        """The spec of a task's `tasks.spec` JSON; a field an older row lacks takes its default here."""
        evaluation = stored.get("evaluation")
        scheduling = stored.get("scheduling") or {}
        objective = stored.get("objective") or {}
        return cls(
            base_model=str(stored["base_model"]),
            training_file=str(stored["training_file"]),
            validation_file=stored.get("validation_file"),
            validation_split=stored.get("validation_split"),
            strategy=str(stored.get("strategy", DEFAULT_STRATEGY)),
            search_space=dict(stored.get("search_space") or {}),
            max_trials=stored.get("max_trials"),
            epochs=stored.get("epochs"),
            max_steps=stored.get("max_steps"),
            max_seq_len=int(stored.get("max_seq_len", DEFAULT_MAX_SEQ_LEN)),
            eval_interval=int(stored["eval_interval"]),
            early_exit=dict(stored.get("early_exit") or NO_EARLY_EXIT),
            seed=int(stored.get("seed", DEFAULT_SEED)),
            training=dict(stored.get("training") or {}),
            scheduling=Scheduling(
                max_trials_per_pack=int(scheduling.get("max_trials_per_pack", DEFAULT_MAX_TRIALS_PER_PACK))),
            evaluation=None if not evaluation else Evaluation(
                metric=str(evaluation.get("metric") or DEFAULT_METRIC),
                max_new_tokens=int(evaluation.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                pattern=evaluation.get("pattern"),
            ),
            suffix=stored.get("suffix"),
            metadata=stored.get("metadata"),
            refit=bool(stored.get("refit", False)),
            training_rows=stored.get("training_rows"),
            validation_rows=stored.get("validation_rows"),
            integrations=tuple(dict(i) for i in stored.get("integrations") or ()),
            objective=Objective(type=str(objective.get("type", "sft")), loss=str(objective.get("loss", "sigmoid")),
                                label_smoothing=float(objective.get("label_smoothing", 0.0))),
        )

    def to_stored(self) -> dict[str, Any]:
        """The JSON stored in `tasks.spec` (`from_stored(to_stored(s)) == s`; an older row's missing
        `evaluation` comes back as null, its missing `refit` as false; `suffix`, `metadata` and `integrations` only when
        given, `objective` only for a DPO task)."""
        stored: dict[str, Any] = {
            "base_model": self.base_model,
            "training_file": self.training_file,
            "validation_file": self.validation_file,
            "validation_split": self.validation_split,
            "strategy": self.strategy,
            "search_space": self.search_space,
            "max_trials": self.max_trials,
            "epochs": self.epochs,
            "max_steps": self.max_steps,
            "max_seq_len": self.max_seq_len,
            "eval_interval": self.eval_interval,
            "early_exit": dict(self.early_exit),
            "seed": self.seed,
            "training": dict(self.training),
            "scheduling": {"max_trials_per_pack": self.scheduling.max_trials_per_pack},
            "evaluation": self.evaluation.as_dict() if self.evaluation else None,
            "refit": self.refit,
            "training_rows": self.training_rows,
            "validation_rows": self.validation_rows,
        }
        if self.objective.dpo:
            stored["objective"] = self.objective.as_dict()
        if self.integrations:
            stored["integrations"] = [dict(i) for i in self.integrations]
        if self.suffix is not None:
            stored["suffix"] = self.suffix
        if self.metadata is not None:
            stored["metadata"] = dict(self.metadata)
        return stored


def refit_steps(winner_steps: int, training_rows: int, validation_rows: int) -> int:
    """The steps of a refit: as many passes over the training and validation rows together as the winner's adapter
    made over the training rows alone (``winner_steps``, the step its delivered adapter was taken at), so the rows
    it gains lengthen it instead of shortening its epochs."""
    if training_rows <= 0:
        raise ValueError("a refit needs the winner's training rows")
    return max(1, round(winner_steps * (training_rows + validation_rows) / training_rows))
