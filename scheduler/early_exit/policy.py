"""Early-exit policies: which trials of one task to stop, hold or resume, from their loss curves (pure).

Workers only report; the scheduler decides, so a decision can rank the trials of a task across packs and
GPUs (docs/DESIGN.md §4). `decide(config, trials)` takes every trial of ONE task — its curves and its state — and
returns what to do now. It keeps no state: every decision is recomputed from the curves, so calling it on
every new validation point with growing curves is safe; the same input gives the same decisions; a trial
that is no longer live (stopped, completed, failed, cancelled) is never decided again.

Policies
  alto  ALTO §5, Algorithm 1 (notes/alto.md §3.1), per validation point of a trial ("evaluation"):
        divergence   the slopes of the smoothed train loss and of the val loss over the last `window`
                     evaluations are both >= tau_slope for `patience_div` evaluations in a row -> stop;
                     active from the first evaluation on.
        overfitting  gap g = (val - ema) / ema > tau_gap for `patience_ovf` evaluations in a row -> stop,
                     with `export_best` set: the trial's best-validation adapter must be exported first.
        under-performance, at `rungs` warm-up rungs: rung k is at warmup_ratio * 2^k of each trial's own
                     steps (`rung_steps`), and a trial's rung point is its first validation point at or
                     past that step. When every trial still in the race has its rung-k point, they are
                     ranked by the val loss there and all but the best ceil(keep_ratio * n) stop; the kept
                     ones race on to rung k + 1. Until then a running trial past its rung point gets "hold"
                     (the service may checkpoint it and give its slot to a trial that has not had its
                     warm-up yet: ALTO's warm-up rotation); once its rung is decided, a kept trial in state
                     "waiting" (held) gets "resume". ALTO itself cuts once (rungs 1, keep 0.25); the
                     defaults here cut twice, gently (see `EarlyExitConfig`).
  asha  asynchronous successive halving (Li et al., 2018) with reduction factor eta and rungs measured in
        training tokens: see `asha_rungs` (the service validates each trial where it reaches a rung:
        `asha_rung_steps`). A trial is judged at the highest rung it has reached against
        every trial of the task that reached that rung so far and continues only in the best ceil(n / eta).
  none  decides nothing.
Both alto and asha stop a trial at once when any of its losses is not finite (NaN/inf): reason "diverging"
with `non_finite` in its numbers (nothing to smooth or rank there; ALTO does not say).

How ALTO's open points are settled here (notes/alto.md §3.1, "Open ambiguities")
  EMA alpha   0.05 per training step (`ema_alpha`, settable): a time constant of ~20 steps. Per-step losses
              of LoRA's small batches (a few rows each) are noisy; 0.05 cuts that noise to sqrt(a/(2-a)) =
              0.16 of a step's, so a single odd batch cannot open a 10% gap, while the EMA lags a
              falling curve by only ~19 steps — inside one evaluation interval for any trial of >= 200
              steps at the default interval (a tenth of the longest trial). The update is
              ema += (1 - (1 - alpha) ** gap_in_steps) * (loss - ema), so curves logged every k steps smooth
              like curves logged every step. The EMA starts at the first train loss (no zero bias).
  sampling    the EMA is read at each validation point (the train points at or before its step), so the
              train and val histories of Algorithm 1 have one entry per evaluation and stay aligned. A val
              point with no train point at or before it is not an evaluation.
  slope unit  per evaluation: linregSlope runs over the evaluation index (0, 1, .., w-1), as Algorithm 1
              reads "the most recent w loss values" and counts "consecutive evaluation steps". With w = 2
              it is the difference of the last two evaluations: tau_slope = 0.001 means "rose by at least
              0.001 since the previous evaluation". So tau_slope depends on the evaluation interval.
  warm-up     5% of each trial's OWN steps: warmup_step = max(1, ceil(warmup_ratio * total_steps)). In an
              epoch budget every trial has then seen the same ~5% of the data, whatever its batch size; in
              a max_steps budget, trials are compared at the same fraction of the budget each will get, so
              the boundary ranking predicts the ranking at the end of those budgets. Later rungs double it.
  defaults    two rungs (5% and 10%) keeping 45% at each (24 trials -> 11 -> 5) instead of ALTO's one cut
              to 25% at 5%: on the committed full sweeps ALTO's cut loses the best trial on both datasets (at
              5% the ranking is weak: Spearman 0.30 on trivia), while the gentle two-step cut keeps it on all
              four (the two it was chosen on and two later sweeps of new data and seeds) and saves 73% of the
              samples (docs/early-exit.md; benchmarks/results/sweeps/SUMMARY.md).
  rotation    held trials wait (on the GPU or checkpointed: the service's choice) until every surviving
              trial of the task has its boundary point; the ranking uses each trial's boundary point, not
              its latest, so a trial that kept training meanwhile is not favoured.
  survivors   the ranking population: every trial with a boundary point whose detectors did not fire at or
              before it, whatever its state now (a trial cut there, completed or failed since, still
              counts). The population never changes once decided, so repeated calls never cut again.
  ties        equal losses rank by trial id, so the order trials are listed in does not matter.
Known limit: a kept trial whose curve is cut back before its boundary (a worker was lost and it resumes
from an older checkpoint) reopens the boundary: the others are held again until it is back past it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from scheduler.early_exit.config import EarlyExitConfig

TrialState = Literal["pending", "running", "waiting", "completed", "stopped_early", "failed", "cancelled"]
Action = Literal["stop", "hold", "resume"]
Reason = Literal["diverging", "overfitting", "underperforming", "asha", "warmup_boundary", "warmup_kept"]

TRIAL_STATES: tuple[str, ...] = ("pending", "running", "waiting", "completed", "stopped_early", "failed", "cancelled")
LIVE_STATES = frozenset({"pending", "running", "waiting"})  # "waiting": held at its warm-up boundary
Number = float | int | str | None


# ---- input and output ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One loss measurement: after `step` optimizer steps the trial had seen `samples` rows and `tokens`
    tokens."""

    step: int
    samples: int
    tokens: int
    loss: float


@dataclass(frozen=True)
class TrialCurves:
    """One trial as a policy sees it: its curves (ascending steps) and its state."""

    trial_id: str
    state: str  # one of TRIAL_STATES
    total_steps: int
    samples_per_step: int  # its batch size
    tokens_per_step: int  # sizes its token budget total_steps * tokens_per_step (asha)
    train: tuple[Point, ...] = ()
    val: tuple[Point, ...] = ()
    # The task's generative metric as the worker scored it at validation steps (its rungs and its end): `loss` holds
    # the score in [0, 1], higher is better. Empty for the loss metric.
    metric: tuple[Point, ...] = ()

    def __post_init__(self) -> None:
        if self.state not in TRIAL_STATES:
            raise ValueError(f"trial {self.trial_id}: unknown state {self.state!r}")
        for name in ("train", "val", "metric"):
            points = tuple(getattr(self, name))
            object.__setattr__(self, name, points)
            steps = [p.step for p in points]
            if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
                raise ValueError(f"trial {self.trial_id}: {name} steps must be strictly increasing")


def curves_from_losses(trial_id: str, state: str, total_steps: int, samples_per_step: int, tokens_per_step: int,
                       train: Iterable[tuple[int, float]], val: Iterable[tuple[int, float]],
                       metric: Iterable[tuple[int, float]] = ()) -> TrialCurves:
    """A trial from (step, loss) points as the service stores them (one train point per step, one val point
    per evaluation, metric scores where the worker scored them, any order), samples and tokens seen counted as
    step x per-step — the rule GET /v1/tasks/{id}/curves writes (there with tokens_per_step = batch size x
    max_seq_len)."""
    def points(xs: Iterable[tuple[int, float]]) -> tuple[Point, ...]:
        return tuple(Point(s, s * samples_per_step, s * tokens_per_step, loss) for s, loss in sorted(xs))

    return TrialCurves(trial_id, state, total_steps, samples_per_step, tokens_per_step, points(train), points(val),
                       points(metric))


@dataclass(frozen=True)
class Decision:
    """What to do with one trial now, why, and the numbers behind it (JSON-ready, for the event)."""

    trial_id: str
    action: Action
    reason: Reason
    step: int  # the trial's evaluation the decision rests on
    export_best: bool = False  # overfitting: export its best-validation adapter before it exits
    numbers: dict[str, Number] = field(default_factory=dict, hash=False)

    @property
    def message(self) -> str:
        return describe(self)

    def event_data(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "step": self.step, "export_best": self.export_best,
                **self.numbers}


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))  # 0.3 * 10 is 3.0000000000000004, and its ceiling must still be 3


def _key(loss: float) -> float:
    return loss if math.isfinite(loss) else math.inf


def rung_steps(config: EarlyExitConfig, total_steps: int) -> tuple[int, ...]:
    """The steps of a trial of `total_steps` steps at which its warm-up rungs fall, one per rung (the service
    validates there): warmup_ratio * 2^k of its steps, at least 1, at most `total_steps`."""
    return tuple(min(total_steps, max(1, _ceil(config.warmup_ratio * 2**k * total_steps)))
                 for k in range(config.rungs))


def warmup_step(config: EarlyExitConfig, total_steps: int) -> int:
    """The step at which a trial of `total_steps` steps ends its warm-up: its first rung."""
    return rung_steps(config, total_steps)[0]


# ---- alto: divergence and overfitting ----------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """Algorithm 1's state after one evaluation (a val point with train points at or before it)."""

    step: int
    val_loss: float
    train_ema: float
    slope_train: float | None  # None until `window` evaluations exist
    slope_val: float | None
    gap: float
    div_count: int
    ovf_count: int


def linreg_slope(ys: Sequence[float]) -> float:
    """Least-squares slope of ys over x = 0, 1, .., len(ys) - 1."""
    n = len(ys)
    x_mean, y_mean = (n - 1) / 2, sum(ys) / n
    return sum((x - x_mean) * (y - y_mean) for x, y in enumerate(ys)) / sum((x - x_mean) ** 2 for x in range(n))


def evaluations(config: EarlyExitConfig, trial: TrialCurves) -> list[Evaluation]:
    """Algorithm 1 run over the trial's whole curve, one entry per evaluation."""
    out: list[Evaluation] = []
    emas: list[float] = []
    vals: list[float] = []
    ema: float | None = None
    last_step = 0
    i = 0
    div = ovf = 0
    train, keep = trial.train, 1 - config.ema_alpha
    for point in trial.val:
        while i < len(train) and train[i].step <= point.step:
            step, loss = train[i].step, train[i].loss
            ema = loss if ema is None else ema + (1 - keep ** (step - last_step)) * (loss - ema)
            last_step = step
            i += 1
        if ema is None:
            continue
        emas.append(ema)
        vals.append(point.loss)
        s_train = s_val = None
        if len(emas) >= config.window:
            s_train, s_val = linreg_slope(emas[-config.window:]), linreg_slope(vals[-config.window:])
            div = div + 1 if s_train >= config.tau_slope and s_val >= config.tau_slope else 0
        gap = (point.loss - ema) / ema if ema > 0 else 0.0  # losses are >= 0; a zero EMA has no ratio
        ovf = ovf + 1 if gap > config.tau_gap else 0
        out.append(Evaluation(point.step, point.loss, ema, s_train, s_val, gap, div, ovf))
    return out


def _first_non_finite(trial: TrialCurves) -> int | None:
    isfinite = math.isfinite
    steps = [next((p.step for p in points if not isfinite(p.loss)), None) for points in (trial.train, trial.val)]
    return min((s for s in steps if s is not None), default=None)


def _non_finite_stop(trial: TrialCurves, step: int) -> Decision:
    return Decision(trial.trial_id, "stop", "diverging", step, numbers={"non_finite": True})


def _best_val(trial: TrialCurves, up_to: int) -> Point | None:
    seen = [p for p in trial.val if p.step <= up_to and math.isfinite(p.loss)]
    return min(seen, key=lambda p: (p.loss, p.step)) if seen else None


def alto_trigger(config: EarlyExitConfig, trial: TrialCurves) -> Decision | None:
    """The first stop divergence, overfitting or a non-finite loss call for on this curve, if any."""
    bad = _first_non_finite(trial)
    for e in evaluations(config, trial):
        if bad is not None and bad <= e.step:
            break
        if e.div_count >= config.patience_div:
            assert e.slope_train is not None and e.slope_val is not None
            return Decision(trial.trial_id, "stop", "diverging", e.step, numbers={
                "slope_train": e.slope_train, "slope_val": e.slope_val, "tau_slope": config.tau_slope,
                "window": config.window, "count": e.div_count, "train_ema": e.train_ema, "val_loss": e.val_loss})
        if e.ovf_count >= config.patience_ovf:
            best = _best_val(trial, e.step)
            return Decision(trial.trial_id, "stop", "overfitting", e.step, export_best=True, numbers={
                "gap": e.gap, "tau_gap": config.tau_gap, "count": e.ovf_count, "train_ema": e.train_ema,
                "val_loss": e.val_loss, "best_val_loss": best.loss if best else None,
                "best_val_step": best.step if best else None})
    return None if bad is None else _non_finite_stop(trial, bad)


def rung_point(config: EarlyExitConfig, trial: TrialCurves, rung: int) -> Point | None:
    """The trial's first validation point at or past its step of warm-up rung `rung` (0-based)."""
    start = rung_steps(config, trial.total_steps)[rung]
    return next((p for p in trial.val if p.step >= start), None)


def boundary_point(config: EarlyExitConfig, trial: TrialCurves) -> Point | None:
    """The trial's first validation point at or past its warm-up step (its first rung's point)."""
    return rung_point(config, trial, 0)


def rung_scores(population: Sequence[tuple[Point, TrialCurves]]) -> dict[str, float] | None:
    """Each trial's metric score at its rung point (the worker scores the task's metric at the validations the
    policy asked for), when every trial of the population has one; None when one lacks it (the metric failed, or an
    older worker): then the rung ranks by validation loss, as without a metric."""
    scores: dict[str, float] = {}
    for point, trial in population:
        score = next((m.loss for m in trial.metric if m.step == point.step), None)
        if score is None or not math.isfinite(score):
            return None
        scores[trial.trial_id] = score
    return scores


def _rank_key(point: Point, trial: TrialCurves, scores: dict[str, float] | None) -> tuple[float, ...]:
    """Best first: the highest metric score (then the lowest val loss) when ``scores``, else the lowest val loss."""
    if scores is None:
        return (_key(point.loss),)
    return (-scores[trial.trial_id], _key(point.loss))


def _ranking_numbers(scores: dict[str, float] | None, trial: TrialCurves,
                     cutoff: tuple[Point, TrialCurves] | None) -> dict[str, Number]:
    """What a rung's decision says it was ranked by: the metric's score and cut-off, or the val loss's."""
    if scores is None:
        return {"ranked_by": "val_loss", "cutoff": cutoff[0].loss if cutoff else None}
    return {"ranked_by": "metric", "metric_score": scores[trial.trial_id],
            "cutoff": scores[cutoff[1].trial_id] if cutoff else None}


def _decide_alto(config: EarlyExitConfig, trials: Sequence[TrialCurves], by_metric: bool) -> dict[str, Decision]:
    out: dict[str, Decision] = {}
    triggers = {t.trial_id: alto_trigger(config, t) for t in trials}
    for t in trials:
        if t.state in LIVE_STATES and (trig := triggers[t.trial_id]) is not None:
            out[t.trial_id] = trig
    racing = list(trials)  # the trials still in the race at this rung
    kept_numbers: dict[str, dict[str, Number]] = {}  # trial -> its ranking at the last rung decided
    for rung in range(config.rungs):
        points = {t.trial_id: rung_point(config, t, rung) for t in racing}
        population = []
        for t in racing:
            point, trig = points[t.trial_id], triggers[t.trial_id]
            if point is not None and (trig is None or trig.step > point.step):
                population.append((point, t))
        waiting_for = [t for t in racing
                       if t.state in LIVE_STATES and points[t.trial_id] is None and t.trial_id not in out]
        if waiting_for:
            for point, t in population:
                if t.state == "running" and t.trial_id not in out:
                    out[t.trial_id] = Decision(t.trial_id, "hold", "warmup_boundary", point.step, numbers={
                        "rung": rung + 1, "rungs": config.rungs, "val_loss": point.loss,
                        "warmup_step": rung_steps(config, t.total_steps)[rung], "waiting_for": len(waiting_for)})
            for t in waiting_for:  # held at the rung before, kept there: it trains on to this rung
                if t.state == "waiting" and t.trial_id in kept_numbers:
                    out[t.trial_id] = _resume(t, kept_numbers[t.trial_id])
            return out
        scores = rung_scores(population) if by_metric else None
        ranked = sorted(population, key=lambda pt: (*_rank_key(pt[0], pt[1], scores), pt[1].trial_id))
        keep = _ceil(config.keep_ratio * len(ranked))
        cutoff = ranked[keep - 1] if ranked else None
        racing, kept_numbers = [], {}
        for rank, (point, t) in enumerate(ranked):
            numbers: dict[str, Number] = {
                "rung": rung + 1, "rungs": config.rungs, "val_loss": point.loss, "rank": rank + 1,
                "ranked": len(ranked), "keep": keep, **_ranking_numbers(scores, t, cutoff),
                "warmup_step": rung_steps(config, t.total_steps)[rung], "step": point.step}
            if rank < keep:
                racing.append(t)
                kept_numbers[t.trial_id] = numbers
            elif t.state in LIVE_STATES and t.trial_id not in out:
                out[t.trial_id] = Decision(t.trial_id, "stop", "underperforming", point.step, numbers=numbers)
    for t in racing:
        if t.state == "waiting" and t.trial_id not in out:
            out[t.trial_id] = _resume(t, kept_numbers[t.trial_id])
    return out


def _resume(trial: TrialCurves, numbers: dict[str, Number]) -> Decision:
    step = numbers["step"]
    assert isinstance(step, int)
    return Decision(trial.trial_id, "resume", "warmup_kept", step,
                    numbers={k: v for k, v in numbers.items() if k != "step"})


# ---- asha ------------------------------------------------------------------------------------------------


def asha_rungs(config: EarlyExitConfig, trials: Sequence[TrialCurves]) -> tuple[int, ...]:
    """The rungs in training tokens, ascending: r_k = ceil(R / eta^k) for k = num_rungs .. 1, where R is the
    task's largest token budget, max(total_steps * tokens_per_step). With eta = 4 and 3 rungs: R/64, R/16,
    R/4. Rungs are absolute token counts shared by all trials of the task, so trials are compared after the
    same amount of training data whatever their batch size. The grace period is one rung: nothing is
    stopped before it reached R / eta^num_rungs (ASHA's minimum resource r, early-stopping rate s = 0).
    Rungs that round to the same count are merged."""
    return asha_rung_tokens(config, max((t.total_steps * t.tokens_per_step for t in trials), default=0))


def asha_rung_tokens(config: EarlyExitConfig, budget: int) -> tuple[int, ...]:
    """`asha_rungs` for a task whose largest token budget is `budget`."""
    if budget <= 0:
        return ()
    eta = config.reduction_factor
    return tuple(sorted({max(1, math.ceil(budget / eta**k)) for k in range(config.num_rungs, 0, -1)}))


def asha_rung_steps(config: EarlyExitConfig, budget: int, tokens_per_step: int, total_steps: int) -> tuple[int, ...]:
    """The steps at which a trial (`tokens_per_step`, `total_steps`) reaches each ASHA rung of a task whose largest
    token budget is `budget`, within its own steps: where it must validate so that its rung points fall there."""
    steps = (math.ceil(tokens / tokens_per_step) for tokens in asha_rung_tokens(config, budget))
    return tuple(sorted({s for s in steps if s <= total_steps}))


def _rung_points(trial: TrialCurves, rungs: Sequence[int]) -> list[Point]:
    """The trial's record at each rung it reached: its first validation point with tokens >= the rung."""
    out: list[Point] = []
    for rung in rungs:
        point = next((p for p in trial.val if p.tokens >= rung), None)
        if point is None:
            break
        out.append(point)
    return out


def _decide_asha(config: EarlyExitConfig, trials: Sequence[TrialCurves], by_metric: bool) -> dict[str, Decision]:
    out: dict[str, Decision] = {}
    rungs = asha_rungs(config, trials)
    records = {t.trial_id: _rung_points(t, rungs) for t in trials}
    by_id = {t.trial_id: t for t in trials}
    for t in trials:
        if t.state not in LIVE_STATES:
            continue
        if (bad := _first_non_finite(t)) is not None:
            out[t.trial_id] = _non_finite_stop(t, bad)
            continue
        mine = records[t.trial_id]
        if not mine:
            continue  # grace: below the first rung
        level = len(mine) - 1
        at_level = [(r[level], by_id[tid]) for tid, r in records.items() if len(r) > level]
        scores = rung_scores(at_level) if by_metric else None
        ranked = sorted(at_level, key=lambda pt: (*_rank_key(pt[0], pt[1], scores), pt[1].trial_id))
        keep = _ceil(len(ranked) / config.reduction_factor)
        rank = [other.trial_id for _, other in ranked].index(t.trial_id)
        if rank >= keep:
            out[t.trial_id] = Decision(t.trial_id, "stop", "asha", mine[level].step, numbers={
                "rung": level + 1, "rungs": len(rungs), "rung_tokens": rungs[level], "tokens": mine[level].tokens,
                "val_loss": mine[level].loss, "rank": rank + 1, "ranked": len(ranked), "keep": keep,
                **_ranking_numbers(scores, t, ranked[keep - 1])})
    return out


# ---- entry point --------------------------------------------------------------------------------------


def decide(config: EarlyExitConfig, trials: Sequence[TrialCurves], *, by_metric: bool = False) -> list[Decision]:
    """The decisions for the trials of ONE task, at most one per trial, in the order they are given.

    Call it with every trial of the task (pending, held and finished ones too: the warm-up ranking and the
    ASHA rungs count them) whenever a validation point arrives. "hold" repeats while it applies (the
    service acts on it once, by moving the trial to "waiting"); "stop" repeats until the trial's state is
    no longer live. ``by_metric`` (a task judged by a generative metric): each rung ranks by the trials' metric
    scores there, higher first, ties by val loss — what the user measures, not the loss — where every trial ranked
    has a score at its rung point (`rung_scores`), by val loss where one lacks it.
    """
    ids = [t.trial_id for t in trials]
    if len(set(ids)) != len(ids):
        raise ValueError("decide() got the same trial twice")
    if config.policy == "alto":
        out = _decide_alto(config, trials, by_metric)
    elif config.policy == "asha":
        out = _decide_asha(config, trials, by_metric)
    else:
        out = {}
    return [out[i] for i in ids if i in out]


def _g(x: Number) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def describe(d: Decision) -> str:
    """One line for the user (the event's message)."""
    n = d.numbers
    if d.reason == "diverging" and n.get("non_finite"):
        return f"Stopped at step {d.step}: diverging (a loss is not finite)."
    if d.reason == "diverging":
        return (f"Stopped at step {d.step}: diverging — smoothed train loss and val loss both rose (slopes "
                f"{_g(n['slope_train'])} and {_g(n['slope_val'])} >= {_g(n['tau_slope'])}) for {n['count']} "
                "evaluations in a row.")
    if d.reason == "overfitting":
        return (f"Stopped at step {d.step}: overfitting — val loss {_g(n['val_loss'])} exceeds the smoothed train "
                f"loss {_g(n['train_ema'])} by {_g(n['gap'])} > {_g(n['tau_gap'])} for {n['count']} evaluations in a "
                f"row; keeping its best adapter (val {_g(n['best_val_loss'])} at step {n['best_val_step']}).")
    measured = (f"metric score {_g(n['metric_score'])}" if n.get("ranked_by") == "metric"
                else f"val loss {_g(n.get('val_loss'))}")
    if d.reason == "underperforming":
        return (f"Stopped at step {d.step}: underperforming — {measured} at warm-up rung "
                f"{n['rung']} of {n['rungs']} ranks {n['rank']} of {n['ranked']}; the best {n['keep']} continue "
                f"(cut-off {_g(n['cutoff'])}).")
    if d.reason == "asha":
        return (f"Stopped at step {d.step}: ASHA rung {n['rung']} of {n['rungs']} ({n['rung_tokens']} tokens) — "
                f"{measured} ranks {n['rank']} of {n['ranked']}; the best {n['keep']} continue "
                f"(cut-off {_g(n['cutoff'])}).")
    if d.reason == "warmup_boundary":
        return (f"Held at step {d.step}: warm-up rung {n['rung']} of {n['rungs']} reached (val loss "
                f"{_g(n['val_loss'])}); waiting for {n['waiting_for']} trial(s) of the task to reach theirs.")
    return (f"Resumed: kept at warm-up rung {n['rung']} of {n['rungs']} (step {d.step}, val loss "
            f"{_g(n['val_loss'])}, rank {n['rank']} of {n['ranked']}).")
