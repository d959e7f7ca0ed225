"""Train a pack of LoRA trials on one frozen base model.

Straightforward engine: each round, every active trial takes one optimizer step on its own micro-batch
with its own adapter slot active. A trial is independent of its pack-mates (own data order, init,
dropout RNG, optimizer), so it trains exactly as it would alone (DESIGN.md §3, tLoRA §3.1).
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine.data import (
    IGNORE_INDEX,
    Batch,
    BatchSampler,
    Example,
    batches_in_order,
    collate,
    encode_rows,
)
from worker.engine.export import export_peft_adapter
from worker.engine.lora import (
    LoraConfig,
    adapter_tensors,
    add_adapter,
    peft_target_modules,
    remove_adapter,
    resolve_target_modules,
    restore_base_model,
    set_active_adapter,
)
from worker.engine.schedule import lr_at
from worker.engine.spec import TrialOutcome, TrialSpec, validate_spec

logger = logging.getLogger(__name__)

PointCallback = Callable[[str, int, str, float], None]  # (trial_id, step, "train" | "val", loss)


@dataclass
class _Run:
    """A trial in flight: its slot, data, optimizer and best checkpoint so far."""

    spec: TrialSpec
    slot: int
    target_paths: list[str]
    train: list[Example]
    val_batches: list[Batch]
    sampler: BatchSampler
    optimizer: torch.optim.Optimizer
    steps_done: int = 0
    last_train_loss: float | None = None
    best_val_loss: float | None = None
    best_step: int | None = None
    best_tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    points: list[tuple[int, str, float]] = field(default_factory=list)  # not yet reported

    def outcome(self, status: str, adapter_dir: Path | None = None, error: str | None = None) -> TrialOutcome:
        return TrialOutcome(
            self.spec.trial_id,
            status,
            self.steps_done,
            self.best_val_loss,
            self.best_step,
            self.last_train_loss,
            adapter_dir,
            error,
        )


def train_pack(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trials: list[TrialSpec],
    *,
    base_model_name: str,
    export_dir: Path,
    on_point: PointCallback,
    should_stop: Callable[[], set[str]] = lambda: set(),
) -> list[TrialOutcome]:
    """Train ``trials`` together on ``model`` and export each completed one to ``export_dir/<trial_id>/``.

    A trial that raises (bad spec, unknown target module, an exception in its step) is ``"failed"`` and
    the others go on; a NaN loss is reported, not an error. Ids returned by ``should_stop`` (polled once
    per round) are dropped at once as ``"stopped"``. Exceptions from ``on_point`` propagate. The model is
    left with no adapter layers, ready for the next pack.

    Returns:
        One outcome per trial, in the order of ``trials``.
    """
    ids = [t.trial_id for t in trials]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate trial ids in pack: {ids}")
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise ValueError("tokenizer has neither a pad nor an eos token")
    model.requires_grad_(False)
    model.eval()  # the base never drops out; LoRA dropout is switched by set_active_adapter

    outcomes: dict[str, TrialOutcome] = {}
    runs: list[_Run] = []
    try:
        for slot, spec in enumerate(trials):
            try:
                runs.append(_setup(model, tokenizer, spec, slot, int(pad_token_id)))
            except Exception as exc:
                logger.warning("trial %s failed during setup: %s", spec.trial_id, exc)
                remove_adapter(model, slot)
                outcomes[spec.trial_id] = TrialOutcome(
                    spec.trial_id, "failed", 0, None, None, None, None, _describe(exc)
                )
        while runs:
            stop = should_stop()
            for run in [r for r in runs if r.spec.trial_id in stop]:
                outcomes[run.spec.trial_id] = run.outcome("stopped")
                _release(model, runs, run)
            for run in list(runs):
                done: TrialOutcome | None
                try:
                    done = _advance(model, run, int(pad_token_id), base_model_name, Path(export_dir))
                except Exception as exc:
                    logger.exception("trial %s failed at step %d", run.spec.trial_id, run.steps_done + 1)
                    done = run.outcome("failed", error=_describe(exc))
                for step, split, loss in run.points:
                    on_point(run.spec.trial_id, step, split, loss)
                run.points.clear()
                if done is not None:
                    outcomes[run.spec.trial_id] = done
                    _release(model, runs, run)
    finally:
        set_active_adapter(model, None)
        restore_base_model(model)
    return [outcomes[i] for i in ids]


def _setup(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: TrialSpec, slot: int, pad_token_id: int
) -> _Run:
    """Validate, tokenise and give the trial a fresh adapter and optimizer in ``slot``."""
    validate_spec(spec)
    train = encode_rows(spec.train_rows, tokenizer, spec.max_seq_len)
    if not train:
        raise ValueError("no training row has a target token left after truncation")
    val = encode_rows(spec.val_rows, tokenizer, spec.max_seq_len)
    if spec.val_rows and not val:
        logger.warning("trial %s: no validation row has a target token; validation is off", spec.trial_id)
    target_paths = resolve_target_modules(model, spec.target_modules)
    config = LoraConfig(rank=spec.lora_rank, alpha=spec.lora_alpha, dropout=spec.lora_dropout)
    params = add_adapter(
        model,
        slot,
        config,
        target_paths,
        init_seed=_seed(spec.seed, "init"),
        dropout_seed=_seed(spec.seed, "dropout"),
    )
    optimizer = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=spec.weight_decay)
    return _Run(
        spec=spec,
        slot=slot,
        target_paths=target_paths,
        train=train,
        val_batches=batches_in_order(val, spec.batch_size, pad_token_id),
        sampler=BatchSampler(len(train), spec.batch_size, _seed(spec.seed, "data")),
        optimizer=optimizer,
    )


def _advance(
    model: PreTrainedModel, run: _Run, pad_token_id: int, base_model_name: str, export_dir: Path
) -> TrialOutcome | None:
    """One step of one trial, then validation and export when due. Returns the outcome once done."""
    spec = run.spec
    run.last_train_loss = _train_step(model, run, pad_token_id)
    run.points.append((run.steps_done, "train", run.last_train_loss))

    last = run.steps_done == spec.max_steps
    if run.val_batches and (run.steps_done % spec.eval_interval == 0 or last):
        val_loss = _evaluate(model, run)
        run.points.append((run.steps_done, "val", val_loss))
        if not math.isnan(val_loss) and (run.best_val_loss is None or val_loss < run.best_val_loss):
            run.best_val_loss, run.best_step = val_loss, run.steps_done
            run.best_tensors = adapter_tensors(model, run.slot)
    if not last:
        return None

    if run.best_tensors is None:  # no validation (or only NaN): the final adapter is the result
        run.best_step, run.best_tensors = run.steps_done, adapter_tensors(model, run.slot)
    adapter_dir = export_peft_adapter(
        export_dir / spec.trial_id,
        run.best_tensors,
        config=LoraConfig(rank=spec.lora_rank, alpha=spec.lora_alpha, dropout=spec.lora_dropout),
        target_modules=peft_target_modules(model, run.target_paths),
        base_model_name=base_model_name,
    )
    return run.outcome("completed", adapter_dir=adapter_dir)


def _train_step(model: PreTrainedModel, run: _Run, pad_token_id: int) -> float:
    """One AdamW step of one trial on its next micro-batch; returns the mean target-token loss."""
    batch = collate([run.train[i] for i in run.sampler.next_indices()], pad_token_id)
    n_targets = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())  # counted on the host: no device sync
    batch = batch.to(_device(model))
    lr = lr_at(
        run.steps_done,
        base_lr=run.spec.learning_rate,
        max_steps=run.spec.max_steps,
        warmup_steps=run.spec.warmup_steps,
        schedule=run.spec.lr_schedule,
    )
    for group in run.optimizer.param_groups:
        group["lr"] = lr

    set_active_adapter(model, run.slot, training=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    loss = token_loss_sum(logits, batch.labels) / n_targets
    del logits  # the (batch, seq, vocab) logits are the largest activation; free before backward peaks
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    run.steps_done += 1
    return float(loss.item())  # device sync: the loss is reported every step


@torch.no_grad()
def _evaluate(model: PreTrainedModel, run: _Run) -> float:
    """Token-weighted mean loss over the trial's validation rows, adapter in eval mode (no dropout)."""
    set_active_adapter(model, run.slot, training=False)
    total = torch.zeros((), dtype=torch.float64, device=_device(model))
    n_targets = 0
    for batch in run.val_batches:
        n_targets += int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
        batch = batch.to(_device(model))
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        total += token_loss_sum(logits, batch.labels).double()
    return float(total.item()) / n_targets


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over target tokens, in fp32.

    Args:
        logits: ``(batch, seq, vocab)``; position ``t`` predicts token ``t + 1``.
        labels: ``(batch, seq)``, ``IGNORE_INDEX`` where there is no target.
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _release(model: PreTrainedModel, runs: list[_Run], run: _Run) -> None:
    """Drop a finished / stopped / failed trial and free its slot (adapter weights and optimizer state)."""
    runs.remove(run)
    remove_adapter(model, run.slot)


def _seed(seed: int, stream: str) -> int:
    """Independent seeds for a trial's init / dropout / data streams, stable across runs and machines."""
    return (seed * 1_000_003 + zlib.crc32(stream.encode())) % 2**63


def _device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
