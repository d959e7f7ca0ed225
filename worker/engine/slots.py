"""What the engine keeps per slot besides tensors (``SlotState``), and what it reports per step (``StepStats``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.batch import SlotRows
from worker.engine.data import BatchSampler, Example
from worker.engine.lora import LoraConfig
from worker.engine.optim import AdamWHyper
from worker.engine.schedule import lr_at
from worker.engine.spec import TrialSpec
from worker.engine.store import ModuleTensors

# The epoch ends a trial exports adapter checkpoints at, at most (`SlotState.checkpoint_epoch_end`).
MAX_EPOCH_CHECKPOINTS = 20

class StepRules:
    """When a trial validates and exports, from its counters alone: the engine's slots (`SlotState`) and a hollow
    worker's (worker/hollow/engine.py) share these rules. A subclass has `spec` and `steps_done`, and says its
    `steps_per_epoch` and whether it has validation rows (`has_val`)."""

    spec: TrialSpec
    steps_done: int

    @property
    def steps_per_epoch(self) -> int:
        raise NotImplementedError

    @property
    def has_val(self) -> bool:
        raise NotImplementedError

    @property
    def epoch_end(self) -> bool:
        return self.steps_done > 0 and self.steps_done % self.steps_per_epoch == 0

    @property
    def eval_due(self) -> bool:
        """Validation is due after the step just taken (every ``eval_interval`` steps and at the last). Not at epoch
        ends for their checkpoints: a validation point more changes what the early-exit policies see (they count
        evaluations), and an epoch's checkpoint is validated only where an evaluation falls on it."""
        every = self.steps_done % self.spec.eval_interval == 0 or self.steps_done in self.spec.extra_eval_steps
        return self.has_val and self.steps_done > 0 and (every or self.steps_done == self.spec.max_steps)

    @property
    def checkpoint_epoch_end(self) -> bool:
        """An epoch's end that gets an adapter checkpoint: every one of a trial of at most `MAX_EPOCH_CHECKPOINTS`
        epochs, else every k-th, evenly spaced. A trial of many tiny epochs (a few rows, many steps) would otherwise
        export every few steps: on `loraplane up` on two cores, such a pack's stream of exports and their reports
        kept the API's uploads waiting past their clients' timeouts."""
        if not self.epoch_end:
            return False
        epochs = -(-self.spec.max_steps // self.steps_per_epoch)
        every = -(-epochs // MAX_EPOCH_CHECKPOINTS)
        return (self.steps_done // self.steps_per_epoch) % every == 0

    @property
    def adapter_checkpoint_due(self) -> bool:
        """Adapter checkpoints are due after the step just taken: at an epoch's end (`checkpoint_epoch_end`) and at
        the last step (the adapter as it is, and the best one if it is older and not exported yet). Only there: each
        costs an export, and exporting every improvement multiplied a small model's pack time
        (benchmarks/checkpoint_cost.py)."""
        steps = self.steps_done
        return self.spec.adapter_checkpoints and steps > 0 and (self.checkpoint_epoch_end
                                                                 or steps == self.spec.max_steps)


@dataclass
class SlotState(StepRules):
    """A trial in a slot: its data and cursor, progress, and its best validation so far.

    The adapter itself and the optimizer moments live in the engine's flat store, row ``slot``.
    """

    spec: TrialSpec
    paths: list[str]  # layers it targets, in model order
    # Its rows as the model reads them: one example per row, or for a DPO trial each preference row's chosen then
    # its rejected sequence (``rows_per_item`` 2: the sampler draws items, a micro-batch holds both of each).
    train: list[Example]
    val: list[Example]
    sampler: BatchSampler
    dropout_seed: int
    # What its rows' reference log-probabilities are cached under (a DPO trial's; worker/engine/dpo.py): the rows'
    # tokenisation key, shared by every trial of the engine that reads the same rows.
    train_key: tuple[str, int] = ("", 0)
    val_key: tuple[str, int] = ("", 0)
    steps_done: int = 0
    # Trained in this pack (since its admission here): what the service's usage accounting shares GPU time by.
    pack_steps: int = 0
    pack_tokens: int = 0  # real (non-padding) tokens
    last_train_loss: float | None = None
    best_val_loss: float | None = None
    best_step: int | None = None
    best: ModuleTensors | None = None  # the best-validation adapter (device clones)
    best_saved_step: int | None = None  # the best adapter's step as last exported as an adapter checkpoint
    failed: bool = False
    # A DPO trial's last validation's reward metrics (``dpo.PreferenceMetrics.as_points``), and those of the
    # validation its best adapter was taken at (its "reward_accuracy" score is the best adapter's).
    val_metrics: dict[str, float] | None = None
    best_metrics: dict[str, float] | None = None

    @property
    def rows_per_item(self) -> int:
        """Sequences per drawn item: 2 for a DPO trial's preference pairs, else 1."""
        return 2 if self.spec.dpo is not None else 1

    def examples_at(self, items: list[int]) -> list[Example]:
        """The training sequences of the drawn ``items`` (a pair's chosen then rejected, for a DPO trial)."""
        k = self.rows_per_item
        return [self.train[k * i + j] for i in items for j in range(k)]

    @property
    def config(self) -> LoraConfig:
        spec = self.spec
        return LoraConfig(spec.lora_rank, spec.lora_alpha, spec.lora_dropout, spec.use_rslora)

    @property
    def training(self) -> bool:
        """Takes part in the next step."""
        return not self.failed and self.steps_done < self.spec.max_steps

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one pass over the training rows (as the service sizes a trial's steps by its epochs)."""
        return max(1, -(-(len(self.train) // self.rows_per_item) // self.spec.batch_size))

    @property
    def has_val(self) -> bool:
        return bool(self.val)

    def lr(self) -> float:
        """Learning rate of the trial's next step (its schedule at its own step)."""
        spec = self.spec
        return lr_at(
            self.steps_done,
            base_lr=spec.learning_rate,
            max_steps=spec.max_steps,
            warmup_steps=spec.warmup_steps,
            schedule=spec.lr_schedule,
        )

    def hyper(self) -> AdamWHyper:
        spec = self.spec
        return AdamWHyper(spec.beta1, spec.beta2, spec.eps, spec.weight_decay, spec.max_grad_norm)


@dataclass(frozen=True)
class StepStats:
    """Measurements of one pack step, for throughput and the planner's cost model (fitted in
    scheduler/planning/cost.py).

    Attributes:
        step: the pack's step index (1-based, counts steps of the engine, not of any trial).
        active_slots: slots that trained in this step.
        tokens: real (non-padding) tokens of the step's batch.
        padded_tokens: padding tokens computed with them: rows go end to end in one stream (no padding between
            them), whose length is rounded up to the engine's width multiple (64 on CUDA, 1 on the CPU), or
            to its shape bucket when the step is captured.
        target_tokens: tokens the loss was computed on.
        seconds: wall time of the step, device work included (it ends with the step's one device sync).
        peak_memory_bytes: CUDA: ``torch.cuda.max_memory_allocated`` since the pack started; CPU: ``None``.
        data_s: host time building the step's batch on its critical path (0 when the prefetch had it).
        prefetch_s: host time building the next step's batch while the device worked (off the critical path).
        sync_wait_s: time the host waited at the step's device sync for work it had queued: near 0, the
            host was the bottleneck; most of ``seconds``, the device was.
        captured: the forward and backward replayed from a CUDA graph (``capture.py``).
    """

    step: int
    active_slots: int
    tokens: int
    padded_tokens: int
    target_tokens: int
    seconds: float
    peak_memory_bytes: int | None
    data_s: float = 0.0
    prefetch_s: float = 0.0
    sync_wait_s: float = 0.0
    captured: bool = False

    @classmethod
    def measure(
        cls, step: int, parts: Sequence[SlotRows], stepped: int, started: float, device: torch.device, width: int,
        *, tokens: int, data_s: float = 0.0, prefetch_s: float = 0.0, sync_wait_s: float = 0.0, captured: bool = False,
    ) -> StepStats:
        """Stats of the step that trained ``parts`` (``stepped`` slots of them; ``tokens`` real tokens, which the
        caller counted per slot) and began at ``started``, in a stream of ``width`` tokens (padding included)."""
        return cls(
            step=step,
            active_slots=stepped,
            tokens=tokens,
            padded_tokens=width - tokens,
            target_tokens=sum(e.n_targets for p in parts for e in p.examples),
            seconds=time.perf_counter() - started,
            peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            data_s=data_s,
            prefetch_s=prefetch_s,
            sync_wait_s=sync_wait_s,
            captured=captured,
        )

    @property
    def padded_fraction(self) -> float:
        """Share of the computed token positions that are padding."""
        total = self.tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0
