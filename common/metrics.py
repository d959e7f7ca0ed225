"""The task's own metric: how a trial's greedy answers to the validation rows are scored (pure, no torch).

A task picks one with `evaluation: {"metric": ..., "max_new_tokens": ..., "pattern": ...}` (default "loss": the
validation loss, and no generation). For a generative metric the worker decodes each validation row's prompt
greedily with the trial's best adapter, up to `max_new_tokens` or the end of the turn, and the score is the share
of rows whose answer passes:

    exact_match  the normalised answer equals the normalised reference (the row's assistant turn or completion)
    contains     the normalised reference occurs in the normalised answer
    regex        `pattern` matches somewhere in the answer (RE2's `search`, on the raw answer). RE2 compiles within
                 a memory budget and matches in time linear in the answer (common/regex_policy.py), so no
                 pattern can stall a worker or grow it.
    json_valid   the answer, stripped of whitespace, parses as JSON

Normalisation (`normalize_answer`): the end-of-turn marker and anything after it are cut by the decoding (it
stops there, and special tokens are not decoded); then case is folded, runs of whitespace become one space, the
ends are stripped, and trailing sentence punctuation (. , ! ? ; :) is removed. So "Paris." and " paris" match
"Paris", while "Paris, France" does not (contains does).

A DPO task (objective "dpo") may instead be judged by `reward_accuracy`: its validation measures it, nothing is
generated, and the best adapter's is the trial's score.

The worker reports the score as a point of split "metric" at each early-exit rung a trial validates at (the
scheduler's `extra_eval_steps`; the trial trains on with its own weights) and when it ends; the newest is the
trial's `metric_score`. Early exit itself still ranks by validation loss (docs/early-exit.md says why). The best
trial of a task with a generative metric is the one with the highest score, ties broken by validation loss
(smoothed: `selection_loss`; `rank_key`, which the scheduler's final ranking and the API's best trial so far share).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from common.regex_policy import PatternRefused, compile_pattern

METRICS = ("loss", "exact_match", "contains", "regex", "json_valid", "reward_accuracy")
GENERATIVE_METRICS = ("exact_match", "contains", "regex", "json_valid")
# A DPO task's (objective "dpo"): the share of validation pairs whose chosen answer the trial's best adapter rewards
# more than the rejected one (its implicit reward: beta times its log-ratio to the base), measured by its
# validation, nothing generated (worker/engine/dpo.py). Reported as the "metric" point like a generative score.
PREFERENCE_METRICS = ("reward_accuracy",)
# The metrics a trial is scored by in [0, 1] ("metric" points): the highest score ranks first.
SCORED_METRICS = GENERATIVE_METRICS + PREFERENCE_METRICS
DEFAULT_METRIC = "loss"
DEFAULT_MAX_NEW_TOKENS = 32
MAX_NEW_TOKENS_LIMIT = 512

# The split of the point a worker reports a trial's score in: [trial_id, step, "metric", score].
METRIC_SPLIT = "metric"
# The points a DPO trial's validation reports besides its loss (worker/engine/dpo.py PREFERENCE_SPLITS, tested
# equal): its reward accuracy, mean reward margin, and mean rewards of the chosen and of the rejected answers.
PREFERENCE_SPLITS = ("reward_acc", "margin", "chosen", "rejected")

_TRAILING_PUNCTUATION = ".,!?;:"
_WHITESPACE = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """Case-folded, whitespace collapsed and stripped, trailing sentence punctuation removed."""
    return _WHITESPACE.sub(" ", text.casefold()).strip().rstrip(_TRAILING_PUNCTUATION).rstrip()


def score_answer(metric: str, answer: str, reference: str, pattern: str | None = None) -> bool:
    """Whether one greedy `answer` passes `metric` against the row's `reference`.

    Raises:
        ValueError: an unknown or non-generative metric, or "regex" without a pattern.
    """
    if metric == "exact_match":
        return normalize_answer(answer) == normalize_answer(reference)
    if metric == "contains":
        return normalize_answer(reference) in normalize_answer(answer)
    if metric == "regex":
        if pattern is None:
            raise ValueError("the regex metric needs a pattern")
        return _searches(compile_pattern(pattern), answer)
    if metric == "json_valid":
        try:
            json.loads(answer.strip())
        except ValueError:
            return False
        return True
    raise ValueError(f"not a generative metric: {metric!r}; choose one of {', '.join(GENERATIVE_METRICS)}")


def _searches(compiled: Any, answer: str) -> bool:
    """Whether RE2's `compiled` pattern matches somewhere in `answer` (an answer that is not valid Unicode text, a
    lone surrogate, matches nothing: RE2 reads UTF-8)."""
    try:
        return compiled.search(answer) is not None
    except UnicodeEncodeError:
        return False


def score_answers(metric: str, answers: list[str], references: list[str], pattern: str | None = None) -> float:
    """The share of answers that pass (0.0 for no rows); a regex metric's pattern is compiled once.

    Raises:
        PatternRefused: the regex metric's pattern is over a limit of the policy (it is not compiled).
    """
    if len(answers) != len(references):
        raise ValueError(f"{len(answers)} answers for {len(references)} references")
    if not answers:
        return 0.0
    if metric == "regex" and pattern is not None:
        compiled = compile_pattern(pattern)
        return sum(_searches(compiled, a) for a in answers) / len(answers)
    return sum(score_answer(metric, a, r, pattern) for a, r in zip(answers, references, strict=True)) / len(answers)


def pattern_error(pattern: str) -> str | None:
    """Why `pattern` cannot be the regex metric's pattern (None: RE2, which the worker searches with, compiles it
    within the policy's limits)."""
    try:
        compile_pattern(pattern)
    except PatternRefused as exc:
        return str(exc)
    return None


RankKey = tuple[Any, ...]

# The weight of the newest validation loss in a trial's smoothed curve (`selection_loss`).
SELECTION_EMA_WEIGHT = 0.5


def selection_loss(val_losses: Sequence[float]) -> float | None:
    """What a trial's validation curve scores when its task's trials are ranked (issue 33): the lowest point of
    the curve smoothed by an exponential average (weight SELECTION_EMA_WEIGHT on the newest loss), in step order;
    None for no points.

    Why not the lowest point itself: on a small validation split each point is noisy, and of many trials the one
    whose curve dipped lowest once is often the one whose noise dipped, not the best (the lowest of many noisy
    minima is biased low). The smoothed curve asks a trial to stay low for more than one evaluation. The adapter a
    trial exports is still its checkpoint of lowest validation loss (`best_step`): this only picks which trial.
    With one point it is that point. benchmarks/quality/selection.py compares the rules on test scores."""
    smoothed: float | None = None
    best: float | None = None
    for loss in val_losses:
        smoothed = loss if smoothed is None else SELECTION_EMA_WEIGHT * loss + (1 - SELECTION_EMA_WEIGHT) * smoothed
        best = smoothed if best is None else min(best, smoothed)
    return best


def ranked_val_loss(selection: float | None, best_val_loss: float | None) -> float | None:
    """What a trial's validation ranks it by (``rank_key``'s ``val_loss``): its stored ``selection_loss``, or its
    lowest validation point where it has none (a trial stored before there was one)."""
    return selection if selection is not None else best_val_loss


def rank_key(metric: str, *, metric_score: float | None, val_loss: float | None,
             last_train_loss: float | None, index: int) -> RankKey:
    """Sort key of a trial among its task's trials: the smallest is the best.

    ``val_loss`` is the trial's validation score (``ranked_val_loss``).

    By loss (metric "loss"): the lowest ``val_loss``; a trial without one ranks after those with one, by its
    last train loss. By a scored metric (generative, or a DPO task's reward accuracy): the highest metric score
    first; ties, and trials without a score (ranked after those with one), by loss as above. Then the lowest index."""
    by_loss = ((0, val_loss, index) if val_loss is not None
               else (1, last_train_loss if last_train_loss is not None else math.inf, index))
    if metric not in SCORED_METRICS:
        return by_loss
    return (0, -metric_score, *by_loss) if metric_score is not None else (1, 0.0, *by_loss)
