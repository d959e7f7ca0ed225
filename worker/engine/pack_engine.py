"""``PackEngine``: a pack of LoRA trials on one frozen base model, one forward and one backward per step.

A step takes every training slot's next micro-batch (its own batch size and seeded data order), runs them
as one packed token stream (rows end to end, no padding, attention within each row: ``attention.py``)
through the model with every slot's adapter applied to its own rows, sums each
slot's mean target-token loss, calls one backward and one vectorised AdamW update. Slots are independent
(own rows, own adapter row, own optimizer row, own dropout keys), so a trial trains exactly as it would
alone (docs/ARCHITECTURE.md, "The training step"; tLoRA §3.1).

This module holds the engine's slots and their admission, and its life (wrapping the model, ``reset`` for the
next pack, ``close``). The rest works on an engine from beside it: the passes through the model (passes.py), the
step (step.py), validation (validation.py), generation (generation.py) and a slot's checkpoint and PEFT export
(slot_export.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine import checkpoint
from worker.engine.attention import use_packed_attention
from worker.engine.capture import StepGraphs, capturable
from worker.engine.data import BatchSampler, Example, encode_rows
from worker.engine.distributed import Lockstep
from worker.engine.dpo import encode_preference_rows
from worker.engine.fused import fuse, unfuse
from worker.engine.lora import ALL_LINEAR, LoraContext, inject_lora, resolve_target_modules
from worker.engine.lora import restore_base_model as _restore
from worker.engine.optim import SlotAdamW
from worker.engine.passes import LOSS_CHUNK_TOKENS, ModelPasses
from worker.engine.recompute import enable_recompute
from worker.engine.slots import SlotState, StepStats
from worker.engine.spec import TrialSpec, trial_seed, validate_spec
from worker.engine.step import TrainingStep
from worker.engine.store import AdapterStore, ModuleTensors

logger = logging.getLogger(__name__)

# Tokenised datasets an engine keeps (each a list of token ids per row, a few MB for thousands of rows).
MAX_ENCODED_DATASETS = 16


class PackEngine:
    """Trains up to ``capacity`` trials at once on ``model``; see the package docstring for the interface.

    Args:
        model: a frozen causal LM (``load_base_model``); its linear layers are wrapped until ``close()``.
        tokenizer: its tokenizer (encodes the trials' rows).
        capacity: ``Z``, slots (fixed for the engine's life).
        device: where to train; the model's device by default.
        max_rank: rank every slot's adapter is padded to; trials of higher rank are refused.
        target_modules: the layers any trial of this pack may target (PEFT patterns; ``None``: all-linear).
        loss_chunk_tokens: target tokens per ``lm_head`` chunk of the loss.
        activation_checkpointing: recompute each decoder layer in the backward (about a third more compute,
            a fraction of the activation memory: what lets many trials at batch > 1 fit).
        lockstep: this engine is one rank of a pack over several GPUs (worker/engine/distributed.py): the base's
            layers are sharded (`shard_base`, before this engine), generation agrees with the other ranks once per
            new token, a failed joint step or validation is not retried slot by slot (the ranks' passes would no
            longer match), and steps run eagerly (a CUDA graph cannot hold the layers' collectives).

    Raises:
        ValueError: a model whose logits are not plainly ``lm_head(last hidden state)``, or bad targets.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        capacity: int,
        device: torch.device | None = None,
        max_rank: int = 64,
        target_modules: list[str] | None = None,
        loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
        activation_checkpointing: bool = False,
        lockstep: Lockstep | None = None,
    ) -> None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("tokenizer has neither a pad nor an eos token")
        if getattr(model.config, "logit_scale", None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} has logit_scale: the chunked loss applies lm_head only")
        parameter = next(model.parameters())
        self.model, self.tokenizer = model, tokenizer
        self.device = device or parameter.device
        self.lockstep = lockstep
        model.requires_grad_(False)
        model.eval()  # the base never drops out; LoRA dropout is the engine's own
        paths = resolve_target_modules(model, target_modules or [ALL_LINEAR])
        self.context = LoraContext(uncaptured=lockstep is not None)  # a rank's steps are never captured (below)
        layers = inject_lora(model, paths, self.context)
        self._base_attention = use_packed_attention(model.config)  # put back by close()
        fuse(model)  # CUDA: Liger's RMSNorm / SwiGLU / RoPE kernels; none on the CPU
        try:
            self.store = AdapterStore(
                layers, capacity=capacity, max_rank=max_rank, device=self.device, compute_dtype=parameter.dtype
            )
        except Exception:
            self._restore_model()
            raise
        if activation_checkpointing:
            enable_recompute(model, self.context)
        self.optimizer = SlotAdamW(self.store.weights, self.store.grads, self.store.compute)
        self.passes = ModelPasses(model, self.context, pad_token_id=int(pad), num_slots=capacity, device=self.device,
                                  loss_chunk_tokens=loss_chunk_tokens)
        # CUDA graphs of the step where the layers allow (capture.py); None: every step runs eagerly.
        graphs = None
        if lockstep is None and capturable(layers, capacity=capacity, max_rank=max_rank, dtype=parameter.dtype,
                                           device=self.device):
            graphs = StepGraphs(self.passes.forward_backward, self.store.grads, layers)
        self.training = TrainingStep(self.passes, self.store, self.optimizer, graphs, retry_alone=lockstep is None)
        self.slots: list[SlotState | None] = [None] * capacity
        self.pack_step = 0
        self._encodings: dict[tuple[str, int], list[Example]] = {}  # see _encode
        self.last_stats: StepStats | None = None
        self.failures: dict[str, str] = {}  # trial id -> error, of the last step's failed slots
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # -- slots ---------------------------------------------------------------------------------------

    def admit(self, spec: TrialSpec, *, resume: Path | None = None) -> int:
        """Put ``spec`` in the lowest free slot: fresh adapter from its seed, fresh optimizer, step 0.

        With ``resume``, continue instead from the checkpoint in that directory. Returns the slot.

        Raises:
            ValueError: an invalid spec, a duplicate trial id, no free slot, a layer this pack does not
                wrap, a rank above ``max_rank``, no trainable row, or a checkpoint that does not fit.
        """
        validate_spec(spec)
        if any(s is not None and s.spec.trial_id == spec.trial_id for s in self.slots):
            raise ValueError(f"trial {spec.trial_id} is already in the pack")
        free = [i for i, s in enumerate(self.slots) if s is None]
        if not free:
            raise ValueError(f"no free slot (capacity {len(self.slots)})")
        paths = resolve_target_modules(self.model, spec.target_modules)
        outside = sorted(set(paths) - set(self.store.index))
        if outside:
            raise ValueError(f"trial {spec.trial_id} targets layers this pack does not wrap: {outside}")
        if spec.dpo is not None and self.lockstep is not None:
            raise ValueError("DPO trials train on one device: a pack over several GPUs takes SFT trials only")
        preference = spec.dpo is not None
        train_key, train = self._encode(spec.train_rows, spec.max_seq_len, preference=preference)
        if not train:
            raise ValueError("no training row has a target token left after truncation")
        val_key, val = self._encode(spec.val_rows, spec.max_seq_len, preference=preference)
        if spec.val_rows and not val:
            logger.warning("trial %s: no validation row has a target token; validation is off", spec.trial_id)
        items = len(train) // (2 if preference else 1)
        state = SlotState(
            spec=spec,
            paths=paths,
            train=train,
            val=val,
            sampler=BatchSampler(items, spec.batch_size, trial_seed(spec.seed, "data")),
            dropout_seed=trial_seed(spec.seed, "dropout"),
            train_key=train_key,
            val_key=val_key,
        )
        slot = free[0]
        config = state.config
        init_seed = trial_seed(spec.seed, "init")
        self.store.init_slot(slot, paths=paths, rank=config.rank, scale=config.scale, seed=init_seed)
        self.optimizer.reset(slot, state.hyper())
        self.slots[slot] = state
        if resume is not None:
            try:
                checkpoint.load_slot(resume, slot=slot, state=state, store=self.store, optimizer=self.optimizer)
            except Exception:
                self.evict(slot)
                raise
        return slot

    def evict(self, slot: int) -> None:
        """Free ``slot``: its adapter, gradient and optimizer state become zeros; nothing is kept."""
        self.store.clear_slot(slot)
        self.optimizer.clear(slot)
        self.slots[slot] = None

    def state(self, slot: int) -> SlotState:
        """The trial in ``slot`` (progress, best validation, spec)."""
        state = self.slots[slot]
        if state is None:
            raise ValueError(f"slot {slot} is free")
        return state

    def adapter(self, slot: int) -> ModuleTensors:
        """Clones of the slot's current ``{path: (A (r, d_in), B (d_out, r))}`` (true rank)."""
        self.state(slot)
        return self.store.read(self.store.weights, slot)

    def use_best(self, slot: int) -> None:
        """Make the slot's best-validation adapter its current weights (for a trial that is finishing: scoring it
        by generation then uses the adapter it will be exported with); nothing without a best."""
        state = self.state(slot)
        if state.best is not None:
            self.store.install(slot, state.best)

    # -- training ------------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One optimizer step of every training slot (step.py); returns ``{trial_id: mean target-token loss}``.

        A slot whose data or step raises is marked failed (``self.failures``; it no longer trains) and
        the others step as usual; a NaN loss is a loss, not a failure. Sets ``self.last_stats``.
        """
        self.failures = {}
        losses, stats = self.training.run(self.slots, self._fail, self.pack_step + 1)
        self.pack_step += 1
        self.last_stats = stats
        return losses

    @property
    def graphs(self) -> StepGraphs | None:
        """The step's CUDA graphs (capture.py); None: every step runs eagerly."""
        return self.training.graphs

    # -- life ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unwrap the model's layers: it is the bare frozen base model again, ready for the next pack."""
        self.training.close()
        self._restore_model()
        self.slots = [None] * len(self.slots)

    def reset(self) -> None:
        """Ready the engine for another pack (worker/engine/keeper.py): every slot free, the step count zero; the
        wrapped layers, the store, the captured graphs and the tokenised rows (a task's next pack, or the next task
        on the same files, tokenises nothing: about a second of its first step for 2,000 chat rows) stay."""
        for slot, state in enumerate(self.slots):
            if state is not None:
                self.evict(slot)
        self.pack_step = 0
        self.last_stats = None
        self.failures = {}
        self.training.prefetched = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def __enter__(self) -> PackEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------------

    def _restore_model(self) -> None:
        _restore(self.model)
        unfuse(self.model)
        self.model.config._attn_implementation = self._base_attention

    def _encode(self, rows: list[dict[str, Any]], max_seq_len: int, *,
                preference: bool = False) -> tuple[tuple[str, int], list[Example]]:
        """Tokenised rows and their key, shared by every trial of the pack with the same data and length: the trials
        of one task tokenise their dataset once, not once each (32 trials took seconds per pack start). Preference
        rows (a DPO trial's) as each pair's chosen then rejected sequence; their reference log-probabilities are
        cached under the same key (``TrainingStep.references``), and go with it."""
        digest = hashlib.sha1(json.dumps(rows, sort_keys=True).encode()).hexdigest()
        key = ("dpo:" + digest if preference else digest, max_seq_len)
        if key not in self._encodings:
            while len(self._encodings) >= MAX_ENCODED_DATASETS:  # the oldest goes: an engine lives across packs
                oldest = next(iter(self._encodings))
                del self._encodings[oldest]
                self.training.references.drop(oldest)
            encode = encode_preference_rows if preference else encode_rows
            self._encodings[key] = encode(rows, self.tokenizer, max_seq_len)
        return key, self._encodings[key]

    def _fail(self, slot: int, exc: BaseException) -> None:
        state = self.state(slot)
        logger.warning("trial %s failed at step %d: %s", state.spec.trial_id, state.steps_done + 1, exc)
        state.failed = True
        self.failures[state.spec.trial_id] = f"{type(exc).__name__}: {exc}"

