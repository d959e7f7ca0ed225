"""``train_pack``: train a list of trials to completion on one ``PackEngine`` and export their adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine.engine import PackEngine
from worker.engine.lora import resolve_target_modules
from worker.engine.slots import StepStats
from worker.engine.spec import TrialOutcome, TrialSpec, validate_spec

logger = logging.getLogger(__name__)

PointCallback = Callable[[str, int, str, float], None]  # (trial_id, step, "train" | "val", loss)
# How to take a trial out of the pack: "drop" it, "export" its best-validation adapter first (an early exit
# for overfitting), or "pause" it (checkpoint, free the slot; it resumes later from the checkpoint).
StopMode = Literal["drop", "export", "pause"]
# Given the free slots, the trials to admit now, each with the checkpoint it resumes from (or None).
Admissions = Callable[[int], list[tuple[TrialSpec, Path | None]]]


def train_pack(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trials: list[TrialSpec],
    *,
    base_model_name: str,
    export_dir: Path,
    on_point: PointCallback,
    should_stop: Callable[[], Mapping[str, StopMode]] = lambda: {},
    on_step: Callable[[StepStats], None] | None = None,
    resume: dict[str, Path] | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_interval: int | None = None,
    on_checkpoint: Callable[[str, int, Path], None] | None = None,
    activation_checkpointing: bool = False,
    capacity: int | None = None,
    max_rank: int | None = None,
    target_modules: list[str] | None = None,
    admissions: Admissions | None = None,
    on_admitted: Callable[[str, str | None], None] | None = None,
    on_outcome: Callable[[TrialOutcome], None] | None = None,
) -> list[TrialOutcome]:
    """Train ``trials`` together on ``model`` and export each completed one to ``export_dir/<trial_id>/``.

    All trials share one ``PackEngine``: one forward and one backward per step. A trial that raises (bad
    spec, unknown target module, no data, an exception in its step) is ``"failed"`` and the others go on; a
    NaN loss is reported, not an error. Trials ``should_stop`` names (polled once per step) leave at once:
    ``"drop"`` and ``"export"`` end them ``"stopped"`` (with the best-validation adapter exported for
    ``"export"``); ``"pause"`` checkpoints them (``on_checkpoint``) and ends them ``"paused"``. Exceptions
    from the callbacks propagate. The model is left with no adapter layers, ready for the next pack.

    Back-filling: the engine has ``capacity`` slots (default: one per trial) of rank up to ``max_rank``
    (default: the trials' largest) over the layers ``target_modules`` select (default: the trials' own).
    Before each step ``admissions(free slots)`` may hand over more trials; each is admitted into a free
    slot (fresh, or from its checkpoint) and trains exactly as it would alone, or is refused
    (``on_admitted(trial_id, reason)``; ``None`` when admitted). The pack ends when no trial is left and
    ``admissions`` has none to give.

    Args:
        on_point: called per train step and per validation of each trial.
        on_step: called with each pack step's ``StepStats``.
        resume: ``{trial_id: checkpoint dir}`` of trials to continue instead of starting fresh.
        checkpoint_dir, checkpoint_interval: checkpoint each trial to ``checkpoint_dir/<trial_id>/`` every
            ``checkpoint_interval`` of its steps (replaced atomically), then call ``on_checkpoint(trial_id,
            step, path)``.
        on_outcome: called with each trial's outcome as soon as the trial ends (its slot is free after).

    Returns:
        One outcome per stay of a trial in the pack: ``trials`` in order, then the admitted ones in the order
        they ended (a trial paused and admitted again has one per stay).
    """
    ids = [t.trial_id for t in trials]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate trial ids in pack: {ids}")
    outcomes: list[TrialOutcome] = []
    report = _Reporter(outcomes, on_outcome)
    ready: list[tuple[TrialSpec, list[str]]] = []
    for spec in trials:
        try:
            validate_spec(spec)
            ready.append((spec, resolve_target_modules(model, spec.target_modules)))
        except Exception as exc:
            logger.warning("trial %s failed during setup: %s", spec.trial_id, exc)
            report(TrialOutcome(spec.trial_id, "failed", 0, None, None, None, None, _describe(exc)))
    if not ready and admissions is None:
        return outcomes
    hooks = _Hooks(on_point, Path(export_dir), base_model_name, checkpoint_dir, checkpoint_interval, on_checkpoint)
    layers = {path for _, paths in ready for path in paths}
    for pattern in target_modules or []:  # room for back-fills; a pattern this model lacks wraps nothing
        try:
            layers |= set(resolve_target_modules(model, [pattern]))
        except ValueError as exc:
            logger.warning("pack layers: %s", exc)
    with PackEngine(
        model,
        tokenizer,
        capacity=max(capacity or 0, len(ready), 1),
        max_rank=max([max_rank or 0, *(spec.lora_rank for spec, _ in ready)]) or 64,
        target_modules=sorted(layers) or None,
        activation_checkpointing=activation_checkpointing,
    ) as engine:
        for spec, _ in ready:
            try:
                engine.admit(spec, resume=(resume or {}).get(spec.trial_id))
            except Exception as exc:
                logger.warning("trial %s failed during setup: %s", spec.trial_id, exc)
                report(TrialOutcome(spec.trial_id, "failed", 0, None, None, None, None, _describe(exc)))
        while True:
            if admissions is not None:
                _admit(engine, admissions, on_admitted)
            live = _live(engine)
            if not live:
                break
            stop = should_stop()
            for slot in [s for s in live if engine.state(s).spec.trial_id in stop]:
                report(_take_out(engine, slot, stop[engine.state(slot).spec.trial_id], hooks))
            losses = engine.step() if any(state.training for state in engine.slots if state) else {}
            if on_step is not None and engine.last_stats is not None and losses:
                on_step(engine.last_stats)
            for slot in _live(engine):
                outcome = _after_step(engine, slot, losses, hooks)
                if outcome is not None:
                    report(outcome)
    order = {trial_id: i for i, trial_id in enumerate(ids)}
    return sorted(outcomes, key=lambda o: order.get(o.trial_id, len(ids)))  # stable: admitted ones as they ended


@dataclass
class _Reporter:
    """Records each outcome and passes it on at once."""

    outcomes: list[TrialOutcome]
    on_outcome: Callable[[TrialOutcome], None] | None

    def __call__(self, outcome: TrialOutcome) -> None:
        self.outcomes.append(outcome)
        if self.on_outcome is not None:
            self.on_outcome(outcome)


def _admit(
    engine: PackEngine, admissions: Admissions, on_admitted: Callable[[str, str | None], None] | None
) -> None:
    """Admit what ``admissions`` hands over into free slots (a trial that left this pack, paused, may come
    back; one still in it is refused: ``engine.admit`` raises)."""
    free = sum(1 for state in engine.slots if state is None)
    if not free:
        return
    for spec, resume in admissions(free):
        reason = None
        try:
            engine.admit(spec, resume=resume)
        except Exception as exc:  # already in the pack, a rank above the pack's, a layer it does not wrap, ...
            reason = _describe(exc)
            logger.warning("trial %s not admitted: %s", spec.trial_id, reason)
        if on_admitted is not None:
            on_admitted(spec.trial_id, reason)


@dataclass(frozen=True)
class _Hooks:
    on_point: PointCallback
    export_dir: Path
    base_model_name: str
    checkpoint_dir: Path | None
    checkpoint_interval: int | None
    on_checkpoint: Callable[[str, int, Path], None] | None


def _after_step(engine: PackEngine, slot: int, losses: dict[str, float], hooks: _Hooks) -> TrialOutcome | None:
    """Report, validate, checkpoint and, once done, export one slot after a pack step.

    Engine work that raises fails this trial only; exceptions from the callbacks propagate.
    Returns the trial's outcome once it has one (the slot is then free).
    """
    state = engine.state(slot)
    trial_id, step = state.spec.trial_id, state.steps_done
    if trial_id in engine.failures:
        return _finish(engine, slot, "failed", engine.failures[trial_id])
    val_loss = checkpoint = None
    try:
        if trial_id in losses and state.eval_due:
            val_loss = engine.evaluate(slot)
        interval = hooks.checkpoint_interval
        if trial_id in losses and hooks.checkpoint_dir is not None and interval and step % interval == 0:
            checkpoint = engine.checkpoint(slot, hooks.checkpoint_dir / trial_id)
        outcome = None if state.training else _finish(engine, slot, "completed", export_to=hooks)
    except Exception as exc:
        logger.exception("trial %s failed after step %d", trial_id, step)
        return _finish(engine, slot, "failed", _describe(exc))
    if trial_id in losses:
        hooks.on_point(trial_id, step, "train", losses[trial_id])
    if val_loss is not None:
        hooks.on_point(trial_id, step, "val", val_loss)
    if checkpoint is not None and hooks.on_checkpoint is not None:
        hooks.on_checkpoint(trial_id, step, checkpoint)
    return outcome


def _take_out(engine: PackEngine, slot: int, mode: StopMode, hooks: _Hooks) -> TrialOutcome:
    """A trial leaving on request (``should_stop``): dropped, exported, or checkpointed to resume later."""
    if mode == "export":
        return _finish(engine, slot, "stopped", export_to=hooks)
    if mode == "pause":
        state = engine.state(slot)
        if hooks.checkpoint_dir is not None:
            path = engine.checkpoint(slot, hooks.checkpoint_dir / state.spec.trial_id)
            if hooks.on_checkpoint is not None:
                hooks.on_checkpoint(state.spec.trial_id, state.steps_done, path)
        return _finish(engine, slot, "paused")
    return _finish(engine, slot, "stopped")


def _finish(
    engine: PackEngine, slot: int, status: str, error: str | None = None, *, export_to: _Hooks | None = None
) -> TrialOutcome:
    """The slot's outcome (exporting its best adapter when ``export_to`` is given); frees the slot."""
    state = engine.state(slot)
    adapter_dir = None
    if export_to is not None:
        out = export_to.export_dir / state.spec.trial_id
        adapter_dir = engine.export(slot, out, base_model_name=export_to.base_model_name)
    best_step = state.best_step
    if adapter_dir is not None and state.best is None:  # no (finite) validation: the final adapter is the result
        best_step = state.steps_done
    outcome = TrialOutcome(
        state.spec.trial_id, status, state.steps_done, state.best_val_loss, best_step, state.last_train_loss,
        adapter_dir, error,
    )
    engine.evict(slot)
    return outcome


def _live(engine: PackEngine) -> list[int]:
    return [slot for slot, state in enumerate(engine.slots) if state is not None]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
