"""``train_pack``: train a list of trials to completion on one ``PackEngine`` and export their adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine.engine import PackEngine
from worker.engine.lora import resolve_target_modules
from worker.engine.slots import StepStats
from worker.engine.spec import TrialOutcome, TrialSpec, validate_spec

logger = logging.getLogger(__name__)

PointCallback = Callable[[str, int, str, float], None]  # (trial_id, step, "train" | "val", loss)


def train_pack(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trials: list[TrialSpec],
    *,
    base_model_name: str,
    export_dir: Path,
    on_point: PointCallback,
    should_stop: Callable[[], set[str]] = lambda: set(),
    on_step: Callable[[StepStats], None] | None = None,
    resume: dict[str, Path] | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_interval: int | None = None,
    on_checkpoint: Callable[[str, int, Path], None] | None = None,
    activation_checkpointing: bool = False,
) -> list[TrialOutcome]:
    """Train ``trials`` together on ``model`` and export each completed one to ``export_dir/<trial_id>/``.

    All trials share one ``PackEngine`` of capacity ``len(trials)``: one forward and one backward per step.
    A trial that raises (bad spec, unknown target module, no data, an exception in its step) is
    ``"failed"`` and the others go on; a NaN loss is reported, not an error. Ids returned by
    ``should_stop`` (polled once per step) are dropped at once as ``"stopped"``. Exceptions from the
    callbacks propagate. The model is left with no adapter layers, ready for the next pack.

    Args:
        on_point: called per train step and per validation of each trial.
        on_step: called with each pack step's ``StepStats``.
        resume: ``{trial_id: checkpoint dir}`` of trials to continue instead of starting fresh.
        checkpoint_dir, checkpoint_interval: checkpoint each trial to ``checkpoint_dir/<trial_id>/`` every
            ``checkpoint_interval`` of its steps (replaced atomically), then call ``on_checkpoint(trial_id,
            step, path)``.

    Returns:
        One outcome per trial, in the order of ``trials``.
    """
    ids = [t.trial_id for t in trials]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate trial ids in pack: {ids}")
    outcomes: dict[str, TrialOutcome] = {}
    ready: list[tuple[TrialSpec, list[str]]] = []
    for spec in trials:
        try:
            validate_spec(spec)
            ready.append((spec, resolve_target_modules(model, spec.target_modules)))
        except Exception as exc:
            logger.warning("trial %s failed during setup: %s", spec.trial_id, exc)
            outcomes[spec.trial_id] = TrialOutcome(spec.trial_id, "failed", 0, None, None, None, None, _describe(exc))
    if not ready:
        return [outcomes[i] for i in ids]
    hooks = _Hooks(on_point, Path(export_dir), base_model_name, checkpoint_dir, checkpoint_interval, on_checkpoint)
    with PackEngine(
        model,
        tokenizer,
        capacity=len(ready),
        max_rank=max(spec.lora_rank for spec, _ in ready),
        target_modules=sorted({path for _, paths in ready for path in paths}),
        activation_checkpointing=activation_checkpointing,
    ) as engine:
        for spec, _ in ready:
            try:
                engine.admit(spec, resume=(resume or {}).get(spec.trial_id))
            except Exception as exc:
                logger.warning("trial %s failed during setup: %s", spec.trial_id, exc)
                outcomes[spec.trial_id] = TrialOutcome(
                    spec.trial_id, "failed", 0, None, None, None, None, _describe(exc)
                )
        while live := _live(engine):
            stop = should_stop()
            for slot in [s for s in live if engine.state(s).spec.trial_id in stop]:
                stopped = _finish(engine, slot, "stopped")
                outcomes[stopped.trial_id] = stopped
            losses = engine.step() if any(state.training for state in engine.slots if state) else {}
            if on_step is not None and engine.last_stats is not None and losses:
                on_step(engine.last_stats)
            for slot in _live(engine):
                outcome = _after_step(engine, slot, losses, hooks)
                if outcome is not None:
                    outcomes[outcome.trial_id] = outcome
    return [outcomes[i] for i in ids]


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
