"""The hollow engine: ``train_pack``'s contract (worker/engine/trainer.py) with the training replaced by a timing model
and replayed losses. Nothing is computed on a device.

What it keeps of the real engine: the slots (``capacity``, back-fills admitted before each step and refused when
already in the pack or above the pack's rank), ``should_stop`` polled every step with its drop / export / pause
semantics, validations at the trial's eval steps (``eval_interval``, ``extra_eval_steps``, the last step), the
best-validation step and loss, adapter checkpoints at epoch ends and the last step, periodic checkpoint snapshots on
``checkpoint_interval_s`` (persisted by the same `PackWriter` thread, superseded ones dropped), a pause's checkpoint
persisted before its outcome, resume from a checkpoint, ``on_step`` with each step's `StepStats`, `PackTimings`.

Where it departs (`DEPARTURES`, which every file it writes repeats): a step sleeps the planner's cost-model time for
the pack (worker/hollow/timing.py) instead of training; losses come from recorded sweeps (worker/hollow/curves.py);
no generative metric is scored and a DPO trial reports no reward metrics; its adapters and checkpoints are a few
hundred bytes of JSON with a hollow marker and no weights; validation and exports take no time.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.engine.export import ADAPTER_CONFIG, PeftFiles
from worker.engine.slots import StepRules, StepStats
from worker.engine.spec import AdapterCheckpoint, PackConfig, TrialOutcome, TrialSpec, validate_spec
from worker.engine.trainer import PackCallbacks, PackTimings, SnapshotClock, StopMode
from worker.engine.writer import PackWriter
from worker.hollow.curves import Curve, Library, data_key, pick_curve, train_loss, val_loss
from worker.hollow.timing import TimingModel, noise_factor, step_model, step_seconds, trial_tokens, wall_seconds

log = logging.getLogger(__name__)

HOLLOW_MARKER = "loraplane_hollow"  # the key every file a hollow worker writes carries, set to true
CHECKPOINT_FILE = "hollow_checkpoint.json"
README = "HOLLOW.md"
DEPARTURES = (
    "trained nothing: each step slept the planner's cost-model step time for the pack (x noise / time scale)",
    "losses replayed from a recorded sweep's curve (replayed_curve), stretched to the trial's steps",
    "no weights: this adapter cannot be loaded, merged, exported or sampled from",
    "no generative metric scored; no DPO reward metrics; validation and exports took no time",
)
README_TEXT = ("# Hollow adapter\n\nWritten by a hollow worker (`loraplane worker --hollow`), which runs the worker's "
               "real shell with the training replaced by a timing model. It holds no weights and is no trained "
               "adapter.\n\n" + "".join(f"- {d}\n" for d in DEPARTURES)).encode()


@dataclass(frozen=True)
class HollowBase:
    """What a hollow worker's model cache holds for a base model: its name only (nothing is loaded)."""

    name: str


@dataclass
class HollowSlot(StepRules):
    """A trial in a hollow pack: its counters, under the engine's own `StepRules` (when it validates and exports)."""

    spec: TrialSpec
    curve: Curve
    tokens: int  # what it adds to each pack step, as the planner counts them
    steps_done: int = 0
    pack_steps: int = 0
    pack_tokens: int = 0
    last_train_loss: float | None = None
    best_val_loss: float | None = None
    best_step: int | None = None
    best_saved_step: int | None = None

    @property
    def training(self) -> bool:
        return self.steps_done < self.spec.max_steps

    @property
    def steps_per_epoch(self) -> int:
        return max(1, -(-len(self.spec.train_rows) // self.spec.batch_size))

    @property
    def has_val(self) -> bool:
        return bool(self.spec.val_rows)

    def facts(self) -> dict[str, Any]:
        """What every file of this trial says about it."""
        return {HOLLOW_MARKER: True, "departures": list(DEPARTURES), "trial_id": self.spec.trial_id,
                "replayed_curve": self.curve.source, "r": self.spec.lora_rank, "lora_alpha": self.spec.lora_alpha,
                "target_modules": self.spec.target_modules}


def hollow_files(facts: dict[str, Any]) -> PeftFiles:
    """A hollow adapter: `adapter_config.json` with the hollow marker and no `peft_type` (PEFT refuses it), a README,
    and no weights file."""
    return PeftFiles({ADAPTER_CONFIG: (json.dumps(facts, indent=1).encode(),), README: (README_TEXT,)})


def read_checkpoint(directory: Path) -> dict[str, Any]:
    """A hollow checkpoint's state; ValueError for anything else (a real worker's checkpoint is not resumed)."""
    path = directory / CHECKPOINT_FILE
    if not path.is_file():
        raise ValueError(f"{directory.name}: not a hollow worker's checkpoint (no {CHECKPOINT_FILE})")
    state: dict[str, Any] = json.loads(path.read_text())
    if state.get(HOLLOW_MARKER) is not True:
        raise ValueError(f"{directory.name}: its checkpoint has no hollow marker")
    return state


class HollowEngine:
    """The engine of every hollow worker of a process: a ``train_pack`` with the real one's signature
    (``PackRunner(train=HollowEngine(...).train_pack)``), the recorded curves and the timing model shared."""

    def __init__(self, library: Library, timing: TimingModel, sleep: Callable[[float], None] = time.sleep) -> None:
        self.library = library
        self.timing = timing
        self.sleep = sleep

    def train_pack(self, model: Any, tokenizer: Any, trials: list[TrialSpec], config: PackConfig,
                   callbacks: PackCallbacks, *, resume: dict[str, Path] | None = None,
                   timings: PackTimings | None = None, lockstep: Any = None, keeper: Any = None) -> list[TrialOutcome]:
        """``worker.engine.train_pack``'s contract on ``model``, a `HollowBase` (``tokenizer``, ``lockstep`` and
        ``keeper`` are not used: a hollow worker is one device, with no engine to keep)."""
        ids = [t.trial_id for t in trials]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate trial ids in pack: {ids}")
        assert isinstance(model, HollowBase), "a hollow engine runs on a hollow worker's stand-in model"
        pack = _HollowPack(self, model.name, trials, config, callbacks, timings or PackTimings())
        return pack.run(resume or {})

    def slot(self, spec: TrialSpec, resume: Path | None) -> HollowSlot:
        """A trial admitted: its curve picked, its counters from its checkpoint when it resumes."""
        validate_spec(spec)
        curve = pick_curve(self.library, data=data_key(spec.train_rows), seed=spec.seed,
                           learning_rate=spec.learning_rate, lora_rank=spec.lora_rank, batch_size=spec.batch_size)
        slot = HollowSlot(spec, curve, trial_tokens(spec.batch_size, spec.max_seq_len, dpo=spec.dpo is not None))
        if resume is not None:
            state = read_checkpoint(resume)
            slot.steps_done = int(state["step"])
            slot.last_train_loss = state.get("last_train_loss")
            slot.best_val_loss, slot.best_step = state.get("best_val_loss"), state.get("best_step")
            slot.best_saved_step = state.get("best_saved_step")
        return slot


class _HollowPack:
    """One pack's loop, in the order of `worker.engine.trainer._run`: admit, take out what should stop, step,
    validate, adapter checkpoints, each slot's end, snapshots."""

    def __init__(self, engine: HollowEngine, base_model: str, trials: list[TrialSpec], config: PackConfig,
                 callbacks: PackCallbacks, clock: PackTimings) -> None:
        self.engine = engine
        self.trials = trials
        self.config = config
        self.calls = callbacks
        self.clock = clock
        self.model = step_model(base_model)
        self.rng = random.Random(zlib.crc32("\0".join(t.trial_id for t in trials).encode()))
        self.writer = PackWriter(name="hollow-pack-writer")
        self.outcomes: list[TrialOutcome] = []
        self.steps = 0
        valid = [t for t in trials if self._valid(t)]
        self.rank = max([config.max_rank or 0, *(t.lora_rank for t in valid)]) or 64
        self.slots: list[HollowSlot | None] = [None] * max(config.capacity or 0, len(valid), 1)
        self.valid = valid

    def _valid(self, spec: TrialSpec) -> bool:
        try:
            validate_spec(spec)
        except ValueError as exc:
            self.report(TrialOutcome(spec.trial_id, "failed", 0, None, None, None, None, f"ValueError: {exc}"))
            return False
        return True

    def report(self, outcome: TrialOutcome) -> None:
        """As the real engine's `_Reporter`: recorded, the trial's waiting snapshot dropped, ``on_outcome`` on the
        writer after the writes queued before it."""
        self.outcomes.append(outcome)
        self.writer.discard(outcome.trial_id)
        on_outcome = self.calls.on_outcome
        if on_outcome is not None:
            self.writer.submit(lambda: on_outcome(outcome))

    def run(self, resume: dict[str, Path]) -> list[TrialOutcome]:
        started = time.perf_counter()
        try:
            for spec in self.valid:
                self._admit(spec, resume.get(spec.trial_id), report_refusal=False)
            if self.valid or self.calls.admissions is not None:
                self._loop(SnapshotClock(self.config.checkpoint_interval_s, time.perf_counter()))
        finally:
            try:
                with self.clock.measure("idle_s"):
                    self.writer.close()
            finally:
                self.clock.wall_s += time.perf_counter() - started
                self.clock.snapshots = self.writer.counts
        order = {t.trial_id: i for i, t in enumerate(self.trials)}
        return sorted(self.outcomes, key=lambda o: order.get(o.trial_id, len(order)))

    def _admit(self, spec: TrialSpec, resume: Path | None, *, report_refusal: bool) -> None:
        """Into the lowest free slot; a trial that cannot be (already here, a rank above the pack's, a checkpoint
        that is no hollow one) fails at the pack's start and is refused as a back-fill."""
        reason = None
        try:
            if any(s is not None and s.spec.trial_id == spec.trial_id for s in self.slots):
                raise ValueError(f"trial {spec.trial_id} is already in this pack")
            if spec.lora_rank > self.rank:
                raise ValueError(f"rank {spec.lora_rank} is above the pack's {self.rank}")
            slot = self.engine.slot(spec, resume)
            self.slots[self.slots.index(None)] = slot
        except Exception as exc:  # noqa: BLE001 - the trial's failure, not the pack's
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("trial %s not admitted: %s", spec.trial_id, reason)
            if not report_refusal:
                self.report(TrialOutcome(spec.trial_id, "failed", 0, None, None, None, None, reason))
        if report_refusal and self.calls.on_admitted is not None:
            self.calls.on_admitted(spec.trial_id, reason)

    def _live(self) -> list[HollowSlot]:
        return [s for s in self.slots if s is not None]

    def _loop(self, snapshots: SnapshotClock) -> None:
        calls = self.calls
        while True:
            self.writer.poll()  # a write or callback that failed stops the pack here
            free = self.slots.count(None)
            if calls.admissions is not None and free:
                for spec, resume in calls.admissions(free):
                    self._admit(spec, resume, report_refusal=True)
            if not self._live():
                break
            stop = calls.should_stop()
            for slot in [s for s in self._live() if s.spec.trial_id in stop]:
                self._take_out(slot, stop[slot.spec.trial_id])
            with self.clock.measure("steps_s"):
                losses = self._step()
            validation = {s.spec.trial_id: self._validate(s) for s in self._live()
                          if s.spec.trial_id in losses and s.eval_due}
            for slot in self._live():
                if slot.adapter_checkpoint_due:
                    self._save_adapters(slot, validation.get(slot.spec.trial_id))
            for slot in self._live():
                self._after_step(slot, losses, validation.get(slot.spec.trial_id))
            if self.config.checkpoint_dir is not None and losses and snapshots.due(time.perf_counter()):
                for slot in self._live():
                    if slot.training and slot.spec.trial_id in losses:
                        self._snapshot(slot, keep=False)
                snapshots.last = time.perf_counter()

    def _step(self) -> dict[str, float]:
        """One pack step of the slots still training: it sleeps the cost model's time (compressed), each slot's
        loss is its curve's, and ``on_step`` gets the step as the simulated GPU would have measured it."""
        stepping = [s for s in self._live() if s.training]
        if not stepping:
            return {}
        started = time.perf_counter()
        tokens = sum(s.tokens for s in stepping)
        seconds = step_seconds(self.model, tokens, len(stepping), noise_factor(self.rng, self.engine.timing.noise))
        losses: dict[str, float] = {}
        for slot in stepping:
            slot.steps_done += 1
            slot.pack_steps += 1
            slot.pack_tokens += slot.tokens
            slot.last_train_loss = losses[slot.spec.trial_id] = train_loss(slot.curve, slot.steps_done,
                                                                           slot.spec.max_steps)
        self.steps += 1
        self.engine.sleep(max(0.0, wall_seconds(seconds, self.engine.timing) - (time.perf_counter() - started)))
        if self.calls.on_step is not None:
            self.calls.on_step(StepStats(step=self.steps, active_slots=len(stepping), tokens=tokens, padded_tokens=0,
                                         target_tokens=tokens, seconds=seconds, peak_memory_bytes=None))
        return losses

    def _validate(self, slot: HollowSlot) -> float:
        loss = val_loss(slot.curve, slot.steps_done, slot.spec.max_steps)
        if math.isfinite(loss) and (slot.best_val_loss is None or loss < slot.best_val_loss):
            slot.best_val_loss, slot.best_step = loss, slot.steps_done
        return loss

    def _after_step(self, slot: HollowSlot, losses: dict[str, float], val: float | None) -> None:
        """The slot's points of this step, then its end once it has trained its steps (completed, its adapter
        exported before its outcome is reported)."""
        outcome = None if slot.training else self._finish(slot, "completed", export=True)
        trial_id = slot.spec.trial_id
        if trial_id in losses:
            self.calls.on_point(trial_id, slot.steps_done, "train", losses[trial_id])
        if val is not None:
            self.calls.on_point(trial_id, slot.steps_done, "val", val)
        if outcome is not None:
            self.report(outcome)

    def _take_out(self, slot: HollowSlot, mode: StopMode) -> None:
        if mode == "export":
            self.report(self._finish(slot, "stopped", export=True))
        elif mode == "pause":
            if self.config.checkpoint_dir is not None:
                self._snapshot(slot, keep=True)
            self.report(self._finish(slot, "paused"))
        else:
            self.report(self._finish(slot, "stopped"))

    def _finish(self, slot: HollowSlot, status: str, *, export: bool = False) -> TrialOutcome:
        """The slot's outcome (its hollow adapter written first when ``export``); frees the slot."""
        adapter_dir = None
        if export:
            adapter_dir = Path(self.config.export_dir) / slot.spec.trial_id
            files = hollow_files({**slot.facts(), "base_model_name_or_path": self.config.base_model_name,
                                  "best_step": slot.best_step, "best_val_loss": slot.best_val_loss})
            self.writer.submit(lambda: files.write_dir(adapter_dir))
        best_step = slot.best_step if not export or slot.best_val_loss is not None else slot.steps_done
        self.slots[self.slots.index(slot)] = None
        return TrialOutcome(slot.spec.trial_id, status, slot.steps_done, slot.best_val_loss, best_step,
                            slot.last_train_loss, adapter_dir, pack_steps=slot.pack_steps,
                            pack_tokens=slot.pack_tokens)

    def _snapshot(self, slot: HollowSlot, *, keep: bool) -> None:
        """The slot's counters, written by the writer to ``checkpoint_dir/<trial_id>/`` and handed to
        ``on_checkpoint``: in order for a pause (``keep``), else superseded by a newer one or the trial's end."""
        assert self.config.checkpoint_dir is not None
        directory = self.config.checkpoint_dir / slot.spec.trial_id
        state = {**slot.facts(), "step": slot.steps_done, "last_train_loss": slot.last_train_loss,
                 "best_val_loss": slot.best_val_loss, "best_step": slot.best_step,
                 "best_saved_step": slot.best_saved_step}
        files = PeftFiles({CHECKPOINT_FILE: (json.dumps(state).encode(),), README: (README_TEXT,)})
        trial_id, step, on_checkpoint, clock = slot.spec.trial_id, slot.steps_done, self.calls.on_checkpoint, self.clock

        def persist() -> None:
            with clock.measure("persist_s"):
                path = files.write_dir(directory)
                if on_checkpoint is not None:
                    on_checkpoint(trial_id, step, path)

        if keep:
            self.writer.submit(persist)
        else:
            self.writer.offer(trial_id, persist)

    def _save_adapters(self, slot: HollowSlot, val: float | None) -> None:
        """As the real engine's: the best adapter first when it is older than this step and not saved yet, then this
        step's; each handed to ``on_adapter_checkpoint`` on the writer, before the trial's outcome."""
        on_saved = self.calls.on_adapter_checkpoint
        if on_saved is None:
            return
        best = slot.best_step
        saves = [(best, slot.best_val_loss)] if best is not None and best < slot.steps_done \
            and best != slot.best_saved_step else []
        saves.append((slot.steps_done, val))
        for step, loss in saves:
            self._submit(on_saved, AdapterCheckpoint(slot.spec.trial_id, step, slot.steps_per_epoch, loss, best,
                                                     hollow_files({**slot.facts(), "step": step})))
        slot.best_saved_step = best

    def _submit(self, on_saved: Callable[[AdapterCheckpoint], None], saved: AdapterCheckpoint) -> None:
        self.writer.submit(lambda: on_saved(saved))
