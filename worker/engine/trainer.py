"""``train_pack``: train a list of trials to completion on one ``PackEngine`` and export their adapters."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine import checkpoint
from worker.engine.data import eval_prompt
from worker.engine.distributed import Lockstep
from worker.engine.dpo import REWARD_ACCURACY
from worker.engine.generation import answer_stop_ids, generate
from worker.engine.keeper import EngineKeeper, EngineShape
from worker.engine.lora import ALL_LINEAR, resolve_target_modules
from worker.engine.pack_engine import PackEngine
from worker.engine.slot_export import prepare_export, prepare_files
from worker.engine.slots import StepStats
from worker.engine.spec import AdapterCheckpoint, Evaluation, PackConfig, TrialOutcome, TrialSpec, validate_spec
from worker.engine.store import slot_bytes
from worker.engine.validation import evaluate, evaluate_slots, evaluation_passes
from worker.engine.writer import PackWriter, WriterCounts

logger = logging.getLogger(__name__)

# (trial_id, step, "train" | "val" | "metric" | a DPO trial's reward metric (dpo.PREFERENCE_SPLITS), value): a loss, a
# metric's score in [0, 1], or a reward metric
PointCallback = Callable[[str, int, str, float], None]
# How to take a trial out of the pack: "drop" it, "export" its best-validation adapter first (an early exit
# for overfitting), or "pause" it (snapshot and persist its checkpoint, free the slot; it resumes later from it).
StopMode = Literal["drop", "export", "pause"]
# Given the free slots, the trials to admit now, each with the checkpoint it resumes from (or None).
Admissions = Callable[[int], list[tuple[TrialSpec, Path | None]]]
# A trial's generative metric: the share of its generated answers that pass against the references, in [0, 1].
# The worker's shell gives it (common/metrics.py); the engine knows no metric.
Scorer = Callable[[Evaluation, list[str], list[str]], float]
# Spare slots (for back-fills) may take this share of the device's free memory at the pack's start; the rest
# is for the trials' activations.
SPARE_SLOTS_MEMORY_FRACTION = 0.25
CUDA_RANK_MULTIPLE = 8  # see _engine_rank


class NoScore(Exception):
    """What a ``Scorer`` raises for a trial that goes without a score (its regex pattern refused when compiled):
    logged, and the pack goes on; any other exception from it propagates."""


def _nothing_stops() -> Mapping[str, StopMode]:
    return {}


@dataclass(frozen=True)
class PackCallbacks:
    """What ``train_pack`` calls back while the pack trains; exceptions from them propagate.

    ``on_checkpoint`` and ``on_outcome`` run on the pack's writer thread (worker/engine/writer.py), after their files
    are written; one that raises stops the pack at its next step.
    """

    on_point: PointCallback  # each train step and validation of each trial, and its generative metric's score
    should_stop: Callable[[], Mapping[str, StopMode]] = _nothing_stops  # polled once per step: trials to take out
    # Each pack step's ``StepStats`` (under a ``lockstep``: on every rank, the whole pack's step over all ranks,
    # ``Lockstep.pack_stats``).
    on_step: Callable[[StepStats], None] | None = None
    # (trial_id, step, path) of each snapshot written, unless a newer one or the trial's end came first
    # (``_Hooks.snapshot``).
    on_checkpoint: Callable[[str, int, Path], None] | None = None
    admissions: Admissions | None = None  # back-fills, asked before each step (see ``train_pack``)
    on_admitted: Callable[[str, str | None], None] | None = None  # (trial_id, None) admitted, or why it was refused
    on_outcome: Callable[[TrialOutcome], None] | None = None  # each trial's outcome once its adapter is written
    # Each adapter checkpoint once written (``TrialSpec.adapter_checkpoints``), before its trial's outcome.
    on_adapter_checkpoint: Callable[[AdapterCheckpoint], None] | None = None
    score: Scorer | None = None  # scores the trials with an ``evaluation`` (None: none is scored by generation)


def train_pack(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trials: list[TrialSpec],
    config: PackConfig,
    callbacks: PackCallbacks,
    *,
    resume: dict[str, Path] | None = None,
    timings: PackTimings | None = None,
    lockstep: Lockstep | None = None,
    keeper: EngineKeeper | None = None,
) -> list[TrialOutcome]:
    """Train ``trials`` together on ``model`` and export each completed one to ``config.export_dir/<trial_id>/``.

    All trials share one ``PackEngine``: one forward and one backward per step. A trial that raises (bad
    spec, unknown target module, no data, an exception in its step) is ``"failed"`` and the others go on; a
    NaN loss is reported, not an error. Trials ``callbacks.should_stop`` names (polled once per step) leave at once:
    ``"drop"`` and ``"export"`` end them ``"stopped"`` (with the best-validation adapter exported for
    ``"export"``); ``"pause"`` checkpoints them and ends them ``"paused"``. Exceptions from the callbacks propagate.
    The model is left with no adapter layers, ready for the next pack.

    Back-filling: the engine has ``config.capacity`` slots (default: one per trial) of rank up to ``config.max_rank``
    (default: the trials' largest) over the layers ``config.target_modules`` select (default: the trials' own).
    Before each step ``callbacks.admissions(free slots)`` may hand over more trials (under a ``lockstep`` it is asked
    every time, with no free slot too); each is admitted into a free slot (fresh, or from its checkpoint) and
    trains exactly as it would alone, or is refused (``on_admitted(trial_id, reason)``; ``None`` when admitted).
    The pack ends when no trial is left and ``admissions`` has none to give.

    Args:
        config: where adapters and checkpoints go, and the engine's room (``PackConfig``).
        callbacks: what the pack reports to and asks (``PackCallbacks``).
        resume: ``{trial_id: checkpoint dir}`` of trials to continue instead of starting fresh.
        timings: filled in with where the pack's wall time went on the training thread.
        keeper: the worker's kept engine (worker/engine/keeper.py): the pack takes it where it fits, and it is kept
            again, with its captured graphs, when the pack ends well (none: a new engine, closed at the end).
        lockstep: this is one rank of a pack over several GPUs (worker/engine/distributed.py): ``trials`` are
            this rank's, the base's layers are already sharded, and the loop runs in step with the other ranks
            until none has a live trial.

    Files are written on a background thread (worker/engine/writer.py) that training never waits for; there
    ``on_checkpoint`` and ``on_outcome`` run after their files (raising here). It returns once all are done.

    Returns:
        One outcome per stay of a trial in the pack: ``trials`` in order, then the admitted ones in the order
        they ended (a trial paused and admitted again has one per stay).
    """
    ids = _unique_ids(trials)
    clock = timings if timings is not None else PackTimings()
    started = time.perf_counter()
    writer = PackWriter()
    report = _Reporter([], callbacks.on_outcome, writer)
    ready = _set_up(model, trials, report)
    snapshots = SnapshotClock(config.checkpoint_interval_s, started)
    hooks = _Hooks(config, callbacks, Path(config.export_dir), snapshots, writer, clock)
    layers = _pack_layers(model, ready, config.target_modules)
    rank = _engine_rank(model, max([config.max_rank or 0, *(spec.lora_rank for spec, _ in ready)]) or 64)
    with _closing_writer(writer, clock, started):
        if ready or callbacks.admissions is not None or lockstep is not None:  # a rank takes part even with no trial
            shape = EngineShape(frozenset(layers), rank, config.activation_checkpointing)
            with _pack_engine(model, tokenizer, shape, config.capacity, len(ready), lockstep, keeper, clock) as engine:
                _run(engine, ready, resume or {}, report, hooks)
    return _in_trial_order(report.outcomes, ids)


def _unique_ids(trials: list[TrialSpec]) -> list[str]:
    ids = [t.trial_id for t in trials]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate trial ids in pack: {ids}")
    return ids


def _set_up(model: PreTrainedModel, trials: list[TrialSpec], report: _Reporter) -> list[tuple[TrialSpec, list[str]]]:
    """The trials whose spec is valid, each with the layers it adapts; the others are reported failed."""
    ready: list[tuple[TrialSpec, list[str]]] = []
    for spec in trials:
        try:
            validate_spec(spec)
            ready.append((spec, resolve_target_modules(model, spec.target_modules)))
        except Exception as exc:
            logger.warning("trial %s failed during setup: %s", spec.trial_id, exc)
            report(TrialOutcome(spec.trial_id, "failed", 0, None, None, None, None, _describe(exc)))
    return ready


def _pack_layers(
    model: PreTrainedModel, ready: list[tuple[TrialSpec, list[str]]], target_modules: list[str] | None
) -> set[str]:
    """The layers the pack wraps: the trials' own, plus those ``target_modules`` selects."""
    layers = {path for _, paths in ready for path in paths}
    for pattern in target_modules or []:  # room for back-fills; a pattern this model lacks wraps nothing
        try:
            layers |= set(resolve_target_modules(model, [pattern]))
        except ValueError as exc:
            logger.warning("pack layers: %s", exc)
    return layers


def _engine_rank(model: PreTrainedModel, rank: int) -> int:
    """The rank the pack's slots are padded to: on CUDA a multiple of ``CUDA_RANK_MULTIPLE``, so that a pack of
    low-rank trials can run from CUDA graphs (worker/engine/capture.py needs ``torch._grouped_mm``, whose rows must
    be 16-byte aligned: rank 4 in bf16 is not). Padded columns are zero and never trained (store.live_columns).
    Measured on an H200 (2026-11-26): an early-exit task's last trial, rank 4 alone in a pack, stepped eagerly at
    0.49 s a step where a captured step of that pack takes ~0.03 s."""
    if next(model.parameters()).device.type != "cuda":
        return rank
    return -(-rank // CUDA_RANK_MULTIPLE) * CUDA_RANK_MULTIPLE


def _new_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    shape: EngineShape,
    capacity: int | None,
    starting: int,
    lockstep: Lockstep | None,
) -> PackEngine:
    """The pack's engine: a slot per trial it starts with (``starting``, at least one) plus the spare ones up to
    ``capacity`` that fit (``_capacity``), each of rank ``shape.max_rank``, over ``shape.layers`` (none: all
    linear layers)."""
    layers, rank = set(shape.layers), shape.max_rank
    return PackEngine(
        model,
        tokenizer,
        capacity=_capacity(model, layers, rank, wanted=capacity or 0, needed=max(starting, 1)),
        max_rank=rank,
        target_modules=sorted(layers) or None,
        activation_checkpointing=shape.activation_checkpointing,
        lockstep=lockstep,
    )


@contextmanager
def _pack_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    shape: EngineShape,
    capacity: int | None,
    starting: int,
    lockstep: Lockstep | None,
    keeper: EngineKeeper | None,
    clock: PackTimings,
) -> Iterator[PackEngine]:
    """The pack's engine for the pack's life: the ``keeper``'s where it fits, else a new one. It goes back to the
    keeper when the pack ends well; one that raised out of the pack is closed (its slots' state is unknown), and so
    is every engine without a keeper or of a rank of a pack over several GPUs (its layers are sharded). Time spent
    capturing graphs is moved from the steps' phase to ``capture_s``."""
    def build() -> PackEngine:
        return _new_engine(model, tokenizer, shape, capacity, starting, lockstep)

    if keeper is None or lockstep is not None:
        engine = build()
    else:
        engine, shape = keeper.take(model, shape, max(starting, 1), build)  # kept again by its own shape
    captured_before = engine.graphs.capture_s if engine.graphs is not None else 0.0
    try:
        yield engine
    except BaseException:
        engine.close()
        raise
    finally:
        captured = (engine.graphs.capture_s if engine.graphs is not None else captured_before) - captured_before
        clock.capture_s += captured
        clock.steps_s -= captured  # the captures ran inside engine.step
    if keeper is not None and lockstep is None:
        keeper.keep(model, shape, engine)
    else:
        engine.close()


@contextmanager
def _closing_writer(writer: PackWriter, clock: PackTimings, started: float) -> Iterator[None]:
    """On the way out, an exception included: wait for the writer's work (raising its first failure) and add the
    pack's wall time since ``started``."""
    try:
        yield
    finally:
        try:
            with clock.measure("idle_s"):
                writer.close()
        finally:
            clock.wall_s += time.perf_counter() - started
            clock.snapshots = writer.counts
            counts = clock.snapshots
            logger.info("pack checkpoints: %d periodic snapshots, %d written, %d dropped (superseded or ended)",
                        counts.offered, counts.done, counts.dropped)


def _in_trial_order(outcomes: list[TrialOutcome], ids: list[str]) -> list[TrialOutcome]:
    order = {trial_id: i for i, trial_id in enumerate(ids)}
    return sorted(outcomes, key=lambda o: order.get(o.trial_id, len(ids)))  # stable: admitted ones as they ended


def spare_slots(slot_bytes: int, free_bytes: int | None, wanted: int) -> int:
    """How many of ``wanted`` spare slots (room for later back-fills) a pack allocates: as many as fit in
    ``SPARE_SLOTS_MEMORY_FRACTION`` of the device's free memory (``None``: no limit, the CPU)."""
    if free_bytes is None or slot_bytes <= 0:
        return wanted
    return max(0, min(wanted, int(free_bytes * SPARE_SLOTS_MEMORY_FRACTION) // slot_bytes))


def _capacity(model: PreTrainedModel, layers: set[str], max_rank: int, *, wanted: int, needed: int) -> int:
    """The pack's slots: one per trial it starts with, plus spare ones up to ``wanted`` where memory allows.

    The adapter store is allocated for every slot at the pack's largest rank: 32 slots of rank 64 on all
    projections of an 8B model would take ~86 GB, more than the GPU's. A back-fill the pack has no slot for is
    refused, and the scheduler places it elsewhere.
    """
    if wanted <= needed:
        return needed
    parameter = next(model.parameters())
    free = torch.cuda.mem_get_info(parameter.device)[0] if parameter.is_cuda else None
    linears = dict(model.named_modules())
    all_layers = layers or set(resolve_target_modules(model, [ALL_LINEAR]))
    dims = [(_linear(linears[path]).in_features, _linear(linears[path]).out_features) for path in sorted(all_layers)]
    spare = spare_slots(slot_bytes(dims, max_rank, parameter.dtype), free, wanted - needed)
    if spare < wanted - needed:
        logger.warning("pack of %d trials: %d of %d spare slots fit in memory", needed, spare, wanted - needed)
    return needed + spare


def _linear(module: torch.nn.Module) -> torch.nn.Linear:
    inner = getattr(module, "base_layer", module)  # a layer already wrapped by a pack
    assert isinstance(inner, torch.nn.Linear), f"{type(module).__name__} is not a linear layer"
    return inner


def _run(
    engine: PackEngine, ready: list[tuple[TrialSpec, list[str]]], resume: dict[str, Path], report: _Reporter,
    hooks: _Hooks,
) -> None:
    """The pack's loop: admit, take out what should stop, step, validate, then each slot's after-step work."""
    for spec, _ in ready:
        try:
            engine.admit(spec, resume=resume.get(spec.trial_id))
        except Exception as exc:
            logger.warning("trial %s failed during setup: %s", spec.trial_id, exc)
            report(TrialOutcome(spec.trial_id, "failed", 0, None, None, None, None, _describe(exc)))
    while True:
        hooks.writer.poll()  # a write or callback that failed stops the pack here
        calls = hooks.calls
        if calls.admissions is not None:
            _admit(engine, calls.admissions, calls.on_admitted)
        live = _live(engine)
        if not (live if engine.lockstep is None else engine.lockstep.any(bool(live))):
            break
        stop = calls.should_stop()
        leaving = [s for s in live if engine.state(s).spec.trial_id in stop]
        _score(engine, [s for s in leaving if stop[engine.state(s).spec.trial_id] == "export"], hooks)
        for slot in leaving:
            report(_take_out(engine, slot, stop[engine.state(slot).spec.trial_id], hooks))
        with hooks.clock.measure("steps_s"):
            losses, stats = _step(engine)
        if calls.on_step is not None and stats is not None:
            calls.on_step(stats)
        with hooks.clock.measure("validation_s"):
            validation = _validate(engine, losses)
        _save_adapters(engine, validation, hooks)  # before a finishing trial's best adapter is installed to score
        finishing = [s for s in _live(engine) if not engine.state(s).training
                     and not isinstance(validation.get(s), BaseException)
                     and engine.state(s).spec.trial_id not in engine.failures]
        _score(engine, finishing, hooks)
        # At the steps the scheduler's early exit ranks trials at (their rungs) the trials that go on are scored too.
        at_rung = [s for s in _live(engine) if engine.state(s).training and isinstance(validation.get(s), float)
                   and engine.state(s).steps_done in engine.state(s).spec.extra_eval_steps]
        _score(engine, at_rung, hooks, training=True)
        for slot in _live(engine):
            outcome = _after_step(engine, slot, losses, validation.get(slot), hooks)
            if outcome is not None:
                report(outcome)
        _snapshot_round(engine, losses, hooks)


def _save_adapters(engine: PackEngine, validation: dict[int, float | BaseException | None], hooks: _Hooks) -> None:
    """The adapter checkpoints due after this step (``SlotState.adapter_checkpoint_due``), of trials that did not
    fail in it: the best adapter first when it is older than this step and not exported yet, then this step's."""
    for slot in _live(engine):
        state, validated = engine.state(slot), validation.get(slot)
        if isinstance(validated, BaseException) or state.spec.trial_id in engine.failures:
            continue
        if state.adapter_checkpoint_due:
            best = state.best_step
            older = best is not None and best < state.steps_done and best != state.best_saved_step
            if state.best is not None and older:
                hooks.save_adapter(engine, slot, state.best_val_loss, best=True)
            hooks.save_adapter(engine, slot, validated)
            state.best_saved_step = best


def _snapshot_round(engine: PackEngine, losses: dict[str, float], hooks: _Hooks) -> None:
    """At a step boundary, once the pack's interval has passed since its last round (``SnapshotClock``): a snapshot of
    every trial that stepped and trains on, for the writer to persist (``_Hooks.snapshot``). One that fails is only
    missed: the trial trains on, and the next round tries again."""
    now = time.perf_counter()
    if hooks.config.checkpoint_dir is None or not losses or not hooks.snapshots.due(now):
        return
    for slot in _live(engine):
        state = engine.state(slot)
        if state.training and state.spec.trial_id in losses:
            try:
                hooks.snapshot(engine, slot)
            except Exception:
                logger.exception("trial %s: no snapshot at step %d", state.spec.trial_id, state.steps_done)
    hooks.snapshots.last = now


@dataclass
class SnapshotClock:
    """When a pack snapshots its trials: every ``interval_s`` seconds since its last round, ``last`` (first: since the
    pack's start). 0: at every step; None: never (a paused trial is snapshotted all the same)."""

    interval_s: float | None
    last: float

    def due(self, now: float) -> bool:
        return self.interval_s is not None and now - self.last >= self.interval_s


def _step(engine: PackEngine) -> tuple[dict[str, float], StepStats | None]:
    """One pack step of the slots still training, and its stats (None: nothing stepped). In a pack over several
    GPUs: an idle pass where this rank has no trial to step and another rank has, and the stats of the whole
    pack's step, over every rank (the scheduler's cost model sees a pack on several GPUs as one)."""
    stepping = any(state.training for state in engine.slots if state)
    lockstep = engine.lockstep
    if lockstep is None:
        losses = engine.step() if stepping else {}
        return losses, engine.last_stats if losses else None
    if not lockstep.any(stepping):
        return {}, None
    if not stepping:
        lockstep.pad(engine.passes, "train", 1)
    losses = engine.step() if stepping else {}
    return losses, lockstep.pack_stats(engine.last_stats if losses else None)


@dataclass
class PackTimings:
    """Where a pack's wall time went on the training thread, in seconds (the rest: callbacks, admissions), and the
    writer thread's time persisting checkpoints beside it (``persist_s``)."""

    wall_s: float = 0.0
    load_s: float = 0.0  # the base model, from the worker's cache or from disk (the runner's)
    capture_s: float = 0.0  # capturing CUDA graphs of the step (warm-up runs included), taken out of steps_s
    steps_s: float = 0.0  # engine.step: forward, backward, optimizer
    validation_s: float = 0.0
    metric_s: float = 0.0  # generation for the trials' generative metric, at their rungs and their end
    snapshot_s: float = 0.0  # snapshots of checkpoints to host memory (their files are written off this thread)
    persist_s: float = 0.0  # the writer thread writing checkpoints and handing them over (on_checkpoint)
    export_s: float = 0.0  # snapshots of finished adapters (their files are written off this thread too)
    idle_s: float = 0.0  # the pack's end waiting for its writer: the last exports and pause checkpoints
    # What became of the periodic snapshots (not a phase: not in ``summary``).
    snapshots: WriterCounts = field(default_factory=WriterCounts)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - started)

    def summary(self) -> dict[str, float | None]:
        """The phases rounded, and the share of the wall time outside training steps."""
        out: dict[str, float | None] = {k: round(v, 3) for k, v in asdict(self).items() if k.endswith("_s")}
        out["outside_steps_frac"] = round(1 - self.steps_s / self.wall_s, 4) if self.wall_s > 0 else None
        return out


@dataclass
class _Reporter:
    """Records each outcome and passes it on once the writes queued before it (its adapter, or its pause checkpoint)
    are done. A periodic snapshot of the trial that has not started is dropped: the trial has ended."""

    outcomes: list[TrialOutcome]
    on_outcome: Callable[[TrialOutcome], None] | None
    writer: PackWriter

    def __call__(self, outcome: TrialOutcome) -> None:
        self.outcomes.append(outcome)
        self.writer.discard(outcome.trial_id)
        on_outcome = self.on_outcome
        if on_outcome is not None:
            self.writer.submit(lambda: on_outcome(outcome))


def _admit(
    engine: PackEngine, admissions: Admissions, on_admitted: Callable[[str, str | None], None] | None
) -> None:
    """Admit what ``admissions`` hands over into free slots (a trial that left this pack, paused, may come
    back; one still in it is refused: ``engine.admit`` raises)."""
    free = sum(1 for state in engine.slots if state is None)
    if not free and engine.lockstep is None:  # the ranks of a pack over several GPUs are all asked, every time:
        return  # handing a back-fill to a rank with room may be an agreement among them (worker/rank_pool.py)
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
    """What the pack's loop hands on to its parts: the pack's config and callbacks, its snapshot clock, writer thread
    and timings."""

    config: PackConfig
    calls: PackCallbacks
    export_dir: Path
    snapshots: SnapshotClock
    writer: PackWriter
    clock: PackTimings

    def snapshot(self, engine: PackEngine, slot: int, *, keep: bool = False) -> None:
        """Snapshot the slot now, to host memory (trial_files.copy_to_host: the device's copy is queued, not waited
        for); the writer thread writes it to ``checkpoint_dir/<trial_id>/`` and calls ``on_checkpoint``. With ``keep``
        (a pause) it is written in order, before the trial's outcome; else a newer snapshot of the trial, or the
        trial's end, drops it if it has not started."""
        assert self.config.checkpoint_dir is not None
        with self.clock.measure("snapshot_s"):
            snapshot = checkpoint.snapshot_slot(slot=slot, state=engine.state(slot), store=engine.store,
                                                optimizer=engine.optimizer)
        directory = self.config.checkpoint_dir / snapshot.trial_id
        on_checkpoint, clock = self.calls.on_checkpoint, self.clock

        def persist() -> None:
            with clock.measure("persist_s"):  # on the writer thread: the training thread never touches persist_s
                path = snapshot.write(directory)
                if on_checkpoint is not None:
                    on_checkpoint(snapshot.trial_id, snapshot.step, path)

        if keep:
            self.writer.submit(persist)
        else:
            self.writer.offer(snapshot.trial_id, persist)


    def save_adapter(self, engine: PackEngine, slot: int, val_loss: float | None, *, best: bool = False) -> None:
        """Hand the slot's adapter as it is now (with ``best``: its best adapter, at its step) to
        ``on_adapter_checkpoint`` as PEFT files in memory: its copy to the host started now, the callback on the
        writer thread, in order before the trial's outcome."""
        on_saved = self.calls.on_adapter_checkpoint
        if on_saved is None:
            return
        state = engine.state(slot)
        step = state.best_step if best and state.best_step is not None else state.steps_done
        with self.clock.measure("export_s"):
            files = prepare_files(engine, slot, base_model_name=self.config.base_model_name, current=not best)
        trial_id, steps_per_epoch, best_step = state.spec.trial_id, state.steps_per_epoch, state.best_step
        clock = self.clock

        def persist() -> None:
            with clock.measure("persist_s"):
                on_saved(AdapterCheckpoint(trial_id, step, steps_per_epoch, val_loss, best_step, files()))

        self.writer.submit(persist)


def _score(engine: PackEngine, slots: list[int], hooks: _Hooks, *, training: bool = False) -> None:
    """The generative metric of trials that finish now with their adapter (completed, or exported on request), or,
    with ``training``, of trials at an early-exit rung that go on training: their best adapters answer their
    validation rows in one batched greedy generation (generation.py) and each trial's share of passing answers
    (``callbacks.score``; without a scorer no trial is scored) is reported as its "metric" point. A trial that goes
    on training gets its current weights back afterwards. A failure here costs the trials their score, not their
    result; in a pack over several GPUs every rank takes part in the generation, with or without trials to score,
    and one that fails in it fails the pack (the ranks' passes no longer match)."""
    _score_rewards(engine, [s for s in slots if _judged_by_rewards(engine.state(s).spec)], hooks)
    scorer = hooks.calls.score
    wanted = [s for s in slots if scorer is not None and engine.state(s).spec.evaluation is not None
              and not _judged_by_rewards(engine.state(s).spec) and engine.state(s).spec.val_rows]
    if not wanted and engine.lockstep is None:
        return
    tokenizer = engine.tokenizer
    current = {slot: engine.adapter(slot) for slot in wanted} if training else {}
    with hooks.clock.measure("metric_s"):
        try:
            prompts, references = _prompts(engine, wanted)
        except Exception:
            logger.exception("scoring %d trials by generation failed; they go without a metric", len(wanted))
            wanted, prompts = [], {}
        try:
            evaluations = {slot: engine.state(slot).spec.evaluation for slot in wanted}
            longest = max([e.max_new_tokens for e in evaluations.values() if e is not None], default=0)
            answers = generate(engine, prompts, max_new_tokens=longest, stop_ids=answer_stop_ids(engine))
        except Exception:
            if engine.lockstep is not None:
                raise
            logger.exception("scoring %d trials by generation failed; they go without a metric", len(wanted))
            return
        finally:
            for slot, tensors in current.items():
                engine.store.install(slot, tensors)
    for slot in wanted:
        state, evaluation = engine.state(slot), evaluations[slot]
        assert evaluation is not None and scorer is not None
        # Greedy decoding is prefix-stable: a trial's shorter budget is the first max_new_tokens of the longest.
        texts = [str(tokenizer.decode(ids[: evaluation.max_new_tokens], skip_special_tokens=True))
                 for ids in answers[slot]]
        try:
            score = scorer(evaluation, texts, references[slot])
        except NoScore as exc:  # e.g. a regex the runner let through that compiling still refuses (recursion)
            logger.error("trial %s goes without a metric: %s", state.spec.trial_id, exc)
            continue
        hooks.calls.on_point(state.spec.trial_id, state.steps_done, "metric", score)


def _judged_by_rewards(spec: TrialSpec) -> bool:
    return spec.dpo is not None and spec.evaluation is not None and spec.evaluation.metric == REWARD_ACCURACY


def _score_rewards(engine: PackEngine, slots: list[int], hooks: _Hooks) -> None:
    """The "metric" point of DPO trials judged by reward accuracy: their best adapter's, as its validation measured
    it (nothing is generated)."""
    for slot in slots:
        state = engine.state(slot)
        if state.best_metrics is not None:
            hooks.calls.on_point(state.spec.trial_id, state.steps_done, "metric", state.best_metrics["reward_acc"])


def _prompts(engine: PackEngine, slots: list[int]) -> tuple[dict[int, list[list[int]]], dict[int, list[str]]]:
    """Each slot's validation prompts and reference answers, with the slot's best adapter installed to answer."""
    prompts: dict[int, list[list[int]]] = {}
    references: dict[int, list[str]] = {}
    for slot in slots:
        spec = engine.state(slot).spec
        pairs = [eval_prompt(row, engine.tokenizer) for row in spec.val_rows]
        prompts[slot] = [ids[-spec.max_seq_len:] for ids, _ in pairs]  # the prompt's end, as training cuts
        references[slot] = [reference for _, reference in pairs]
        engine.use_best(slot)
    return prompts, references


def _validate(engine: PackEngine, losses: dict[str, float]) -> dict[int, float | BaseException | None]:
    """Validation of every slot due after this step, in shared forwards; if those raise, slot by slot, so
    only the slots that break fail (their exception is their result)."""
    due = [s for s in _live(engine) if engine.state(s).spec.trial_id in losses and engine.state(s).eval_due]
    if engine.lockstep is not None:
        return _validate_in_step(engine, engine.lockstep, due)
    if not due:
        return {}
    try:
        return dict(evaluate_slots(engine, due))
    except Exception as exc:
        logger.warning("joint validation of %d slots failed (%s); validating them one by one", len(due), exc)
    results: dict[int, float | BaseException | None] = {}
    for slot in due:
        try:
            results[slot] = evaluate(engine, slot)
        except Exception as exc:
            results[slot] = exc
    return results


def _validate_in_step(
    engine: PackEngine, lockstep: Lockstep, due: list[int]
) -> dict[int, float | BaseException | None]:
    """``_validate`` on one rank of a pack over several GPUs: the ranks agree on the phase's forwards and this rank
    pads its own to that (distributed.py); no slot-by-slot retry, whose passes the other ranks would not run."""
    own = evaluation_passes(engine, due) if due else 0
    passes = lockstep.most(own)
    results: dict[int, float | BaseException | None] = dict(evaluate_slots(engine, due)) if due else {}
    lockstep.pad(engine.passes, "forward", passes - own)
    return results


def _after_step(
    engine: PackEngine, slot: int, losses: dict[str, float], validated: float | BaseException | None, hooks: _Hooks
) -> TrialOutcome | None:
    """Report and, once done, export one slot after a pack step (``validated``: its validation loss of this step, if
    it was due, or the exception its validation raised).

    Engine work that raises fails this trial only; exceptions from the callbacks propagate.
    Returns the trial's outcome once it has one (the slot is then free).
    """
    state = engine.state(slot)
    trial_id, step = state.spec.trial_id, state.steps_done
    if trial_id in engine.failures:
        return _finish(engine, slot, "failed", engine.failures[trial_id])
    val_loss = None
    try:
        if isinstance(validated, BaseException):
            raise validated
        val_loss = validated
        outcome = None if state.training else _finish(engine, slot, "completed", export_to=hooks)
    except Exception as exc:
        logger.exception("trial %s failed after step %d", trial_id, step)
        return _finish(engine, slot, "failed", _describe(exc))
    if trial_id in losses:
        hooks.calls.on_point(trial_id, step, "train", losses[trial_id])
    if val_loss is not None:
        hooks.calls.on_point(trial_id, step, "val", val_loss)
        for split, value in (state.val_metrics or {}).items():  # a DPO trial's reward metrics
            hooks.calls.on_point(trial_id, step, split, value)
    return outcome


def _take_out(engine: PackEngine, slot: int, mode: StopMode, hooks: _Hooks) -> TrialOutcome:
    """A trial leaving on request (``should_stop``): dropped, exported, or checkpointed to resume later (its snapshot
    is persisted before its outcome is reported)."""
    if mode == "export":
        return _finish(engine, slot, "stopped", export_to=hooks)
    if mode == "pause":
        if hooks.config.checkpoint_dir is not None:
            hooks.snapshot(engine, slot, keep=True)
        return _finish(engine, slot, "paused")
    return _finish(engine, slot, "stopped")


def _finish(
    engine: PackEngine, slot: int, status: str, error: str | None = None, *, export_to: _Hooks | None = None
) -> TrialOutcome:
    """The slot's outcome (exporting its best adapter when ``export_to`` is given); frees the slot."""
    state = engine.state(slot)
    adapter_dir = None
    if export_to is not None:
        adapter_dir = export_to.export_dir / state.spec.trial_id
        with export_to.clock.measure("export_s"):
            write = prepare_export(engine, slot, adapter_dir, base_model_name=export_to.config.base_model_name)
        export_to.writer.submit(write)  # the outcome's report is queued after it
    best_step = state.best_step
    if adapter_dir is not None and state.best is None:  # no (finite) validation: the final adapter is the result
        best_step = state.steps_done
    outcome = TrialOutcome(
        state.spec.trial_id, status, state.steps_done, state.best_val_loss, best_step, state.last_train_loss,
        adapter_dir, error, pack_steps=state.pack_steps, pack_tokens=state.pack_tokens,
    )
    engine.evict(slot)
    return outcome


def _live(engine: PackEngine) -> list[int]:
    return [slot for slot, state in enumerate(engine.slots) if state is not None]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
