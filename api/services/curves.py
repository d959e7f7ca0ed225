"""A task's loss curves as JSONL, one row per trial: the file `loraplane replay` reads.

    {"trial_id": "trial-…", "task_id": "task-…", "index": 0, "state": "completed",
     "hyperparameters": {...}, "samples_per_step": 4, "tokens_per_step": 2048, "total_steps": 500,
     "train": [[step, samples seen, tokens seen, loss], ...], "val": [[...], ...],
     "metric": [[step, samples seen, tokens seen, score], ...]}

From the stored metric points: samples seen = batch size x step; tokens seen = batch size x max_seq_len x
step, i.e. tokens_per_step is the task's max_seq_len per row — an upper bound (rows are cut at max_seq_len
and shorter ones are padded, and padding is not trained on), the same for every trial of the task, which is
what ranking trials at equal tokens needs (a DPO trial's tokens_per_step counts both sequences of a row).
`metric`: the trial's scores on its task's scored metric (at its early-exit rungs and the step it ended; empty for
the loss metric), which `loraplane replay` ignores. A DPO trial's row also has `rewards`: {"reward_acc", "margin",
"chosen", "rejected"}, each [[step, samples seen, tokens seen, value], ...] at its validations (its validation
pairs' reward accuracy, mean reward margin, and mean chosen and rejected rewards), and its `val` is its DPO loss.
A non-finite loss is written as null. Like an adapter download (api/services/adapters.py), a response already begun
runs to its end if its key is revoked meanwhile: it is finite (one line per trial of the task) and was authorised
when it began. A task trained with early exit gives curves that end where its trials stopped; replaying a policy
needs a sweep trained without (`early_exit: {"policy": "none"}`). The format is documented in scheduler/sim/replay.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from api.db import session_factory
from common.metrics import METRIC_SPLIT, PREFERENCE_SPLITS
from common.tables import MetricPoint, Task, Trial
from scheduler.planning.cost import batch_size, tokens_per_step


@dataclass(frozen=True)
class TrialHead:
    """What a row needs of a trial, read before the response streams (the request's session is gone by then)."""

    id: str
    index: int
    state: str
    hyperparameters: dict[str, Any]
    total_steps: int

    @classmethod
    def of(cls, trial: Trial) -> TrialHead:
        return cls(trial.id, trial.index, trial.state, dict(trial.hyperparameters), trial.total_steps)


def curve_row(
    task_id: str, max_seq_len: int, trial: TrialHead, points: Sequence[tuple[str, int, float]]
) -> dict[str, Any]:
    """The row of one trial from its (split, step, loss) points in step order."""
    batch, tokens = batch_size(trial.hyperparameters), tokens_per_step(trial.hyperparameters, max_seq_len)
    dpo = "beta" in trial.hyperparameters  # a DPO trial: its validations' reward metrics too
    splits = ("train", "val", METRIC_SPLIT, *(PREFERENCE_SPLITS if dpo else ()))
    curves: dict[str, list[list[Any]]] = {split: [] for split in splits}
    for split, step, loss in points:
        if split in curves:
            curves[split].append([step, step * batch, step * tokens, loss if math.isfinite(loss) else None])
    row = {"trial_id": trial.id, "task_id": task_id, "index": trial.index, "state": trial.state,
           "hyperparameters": trial.hyperparameters, "samples_per_step": batch, "tokens_per_step": tokens,
           "total_steps": trial.total_steps, "train": curves["train"], "val": curves["val"],
           "metric": curves[METRIC_SPLIT]}
    if dpo:
        row["rewards"] = {split: curves[split] for split in PREFERENCE_SPLITS}
    return row


def curve_lines(task: Task, trials: Sequence[Trial], after_step: int | None = None) -> Iterator[bytes]:
    """One JSON line per trial; each trial's points are read in their own short session as the response
    streams, so a large task is never held in memory whole, nor a connection held between trials.
    `after_step`: only points past that step (a live view fetches what is new, not the whole curve again)."""
    task_id, max_seq_len = task.id, task.parsed_spec.max_seq_len
    heads = [TrialHead.of(t) for t in trials]

    def lines() -> Iterator[bytes]:
        for head in heads:
            stmt = (select(MetricPoint.split, MetricPoint.step, MetricPoint.loss)
                    .where(MetricPoint.trial_id == head.id).order_by(MetricPoint.split, MetricPoint.step))
            if after_step is not None:
                stmt = stmt.where(MetricPoint.step > after_step)
            with session_factory()() as session:
                points = [(split, step, loss) for split, step, loss in session.execute(stmt)]
            row = curve_row(task_id, max_seq_len, head, points)
            yield (json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n").encode()

    return lines()
