"""``PackEngine``: a pack of LoRA trials on one frozen base model, one forward and one backward per step.

A step takes every training slot's next micro-batch (its own batch size and seeded data order), runs them
as one packed token stream (rows end to end, no padding, attention within each row: ``attention.py``)
through the model with every slot's adapter applied to its own rows, sums each
slot's mean target-token loss, calls one backward and one vectorised AdamW update. Slots are independent
(own rows, own adapter row, own optimizer row, own dropout keys), so a trial trains exactly as it would
alone (docs/ARCHITECTURE.md, "The training step"; tLoRA §3.1).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine import checkpoint, feed
from worker.engine.attention import use_packed_attention
from worker.engine.batch import PackedBatch, SlotRows, pack_rows
from worker.engine.capture import StepGraphs, capturable
from worker.engine.data import IGNORE_INDEX, BatchSampler, Example, encode_rows
from worker.engine.distributed import Lockstep
from worker.engine.export import export_peft_adapter
from worker.engine.feed import BatchKey
from worker.engine.fused import fuse, unfuse
from worker.engine.lora import ALL_LINEAR, LoraContext, inject_lora, peft_target_modules, resolve_target_modules
from worker.engine.lora import restore_base_model as _restore
from worker.engine.loss import SoftCappedHead, slot_loss_sums
from worker.engine.optim import SlotAdamW
from worker.engine.recompute import enable_recompute
from worker.engine.slots import SlotState, StepStats
from worker.engine.spec import TrialSpec, trial_seed, validate_spec
from worker.engine.store import AdapterStore, ModuleTensors

logger = logging.getLogger(__name__)

# On CUDA, the packed stream's length is rounded up to this: fewer distinct GEMM shapes for cuBLAS to plan, at
# most 63 tokens of padding a step (on the CPU there is nothing to gain, and exact lengths keep the tests' numbers).
CUDA_WIDTH_MULTIPLE = 64

LOSS_CHUNK_TOKENS = 4096  # target tokens per lm_head chunk: bounds the (chunk, vocab) logits of the loss
# Tokens per validation forward (evaluate_slots): no activations are kept for a backward, so a forward holds
# one layer's intermediates at a time; as large as a training step of a full pack, and bounded.
EVAL_MAX_TOKENS = 32768
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
        cap = getattr(model.config, "final_logit_softcapping", None)
        self.logit_softcap = float(cap) if cap else None  # Gemma 2: the loss caps the logits as the model does
        parameter = next(model.parameters())
        self.model, self.tokenizer, self.pad_token_id = model, tokenizer, int(pad)
        self.device = device or parameter.device
        self.loss_chunk_tokens = loss_chunk_tokens
        self.lockstep = lockstep
        model.requires_grad_(False)
        model.eval()  # the base never drops out; LoRA dropout is the engine's own
        paths = resolve_target_modules(model, target_modules or [ALL_LINEAR])
        self.context = LoraContext()
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
        # CUDA graphs of the step where the layers allow (capture.py); None: every step runs eagerly.
        self.graphs: StepGraphs | None = None
        if lockstep is None and capturable(layers, capacity=capacity, max_rank=max_rank, dtype=parameter.dtype,
                                           device=self.device):
            self.graphs = StepGraphs(self._forward_backward, self.store.grads, layers)
        self.slots: list[SlotState | None] = [None] * capacity
        self.pack_step = 0
        self._encodings: dict[tuple[str, int], list[Example]] = {}  # see _encode
        self.last_stats: StepStats | None = None
        self.failures: dict[str, str] = {}  # trial id -> error, of the last step's failed slots
        self._prefetched: tuple[BatchKey, PackedBatch] | None = None
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
        train = self._encode(spec.train_rows, spec.max_seq_len)
        if not train:
            raise ValueError("no training row has a target token left after truncation")
        val = self._encode(spec.val_rows, spec.max_seq_len)
        if spec.val_rows and not val:
            logger.warning("trial %s: no validation row has a target token; validation is off", spec.trial_id)
        state = SlotState(
            spec=spec,
            paths=paths,
            train=train,
            val=val,
            sampler=BatchSampler(len(train), spec.batch_size, trial_seed(spec.seed, "data")),
            dropout_seed=trial_seed(spec.seed, "dropout"),
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

    # -- training ------------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One optimizer step of every training slot; returns ``{trial_id: mean target-token loss}``.

        A slot whose data or step raises is marked failed (``self.failures``; it no longer trains) and
        the others step as usual; a NaN loss is a loss, not a failure. Sets ``self.last_stats``.
        """
        started = time.perf_counter()
        self.failures = {}
        parts, key = feed.draw(self.slots, self._fail)
        prefetched, self._prefetched = self._prefetched, None
        batch = prefetched[1] if prefetched is not None and prefetched[0] == key else None
        self.store.grads.zero_()
        losses, data_s, width, captured = self._losses_and_grads(parts, batch)
        stepped = [p.slot for p in parts if not self.state(p.slot).failed]
        self.optimizer.step(  # also refreshes store.compute; only as far into each row as its rank reaches
            {slot: self.state(slot).lr() for slot in stepped}, {slot: self.store.live_columns(slot) for slot in stepped}
        )
        prefetch_started = time.perf_counter()
        self._prefetched = self._prefetch(stepped)  # host work while the device computes this step
        sync_started = time.perf_counter()
        values = losses.tolist()  # the step's one device sync: it waits for the update queued above
        sync_s = time.perf_counter() - sync_started
        part_tokens = [sum(len(e.input_ids) for e in part.examples) for part in parts]
        for part, tokens in zip(parts, part_tokens, strict=True):
            state = self.state(part.slot)
            if not state.failed:
                state.steps_done += 1
                state.pack_steps += 1
                state.pack_tokens += tokens
                state.last_train_loss = values[part.slot]
        self.pack_step += 1
        self.last_stats = StepStats.measure(
            self.pack_step, parts, len(stepped), started, self.device, width, tokens=sum(part_tokens),
            data_s=data_s, prefetch_s=sync_started - prefetch_started, sync_wait_s=sync_s, captured=captured,
        )  # fmt: skip
        return {self.state(slot).spec.trial_id: values[slot] for slot in stepped}

    def _prefetch(self, stepped: list[int]) -> tuple[BatchKey, PackedBatch] | None:
        """Pack the next step's batch now, while the device is busy; ``step()`` uses it only if it then
        draws exactly these micro-batches (``feed.peek``)."""
        parts, key = feed.peek(self.slots, stepped)
        if not parts:
            return None
        try:
            return key, self._pack(parts, static_shapes=self.graphs is not None)
        except Exception:  # the step that needs it packs again and fails (or not) on its own
            return None

    def _losses_and_grads(
        self, parts: list[SlotRows], batch: PackedBatch | None
    ) -> tuple[torch.Tensor, float, int, bool]:
        """``(Z,)`` per-slot mean losses, gradients accumulated into ``store.grads``, the seconds spent
        packing the joint batch on the step's critical path (0 when ``batch`` came prefetched), the stream's
        tokens (padding included) and whether a CUDA graph ran the step.

        If the joint forward/backward raises, each slot is retried alone (slots are independent, so the
        gradients are the same), to fail only the slot(s) that break.
        """
        losses = torch.zeros(len(self.slots), device=self.device)
        data_s = 0.0
        if not parts:
            return losses, data_s, 0, False
        try:
            if batch is None:  # the prefetch missed
                data_started = time.perf_counter()
                batch = self._pack(parts, static_shapes=self.graphs is not None)
                data_s = time.perf_counter() - data_started
            width = int(batch.input_ids.shape[1])
            captured = self.graphs.run(batch) if self.graphs is not None else None
            if captured is not None:
                return captured, data_s, width, True
            return self._forward_backward(batch), data_s, width, False
        except Exception as exc:
            if len(parts) == 1 or self.lockstep is not None:  # a retry would run passes the other ranks do not
                for part in parts:
                    self._fail(part.slot, exc)
                return losses, data_s, 0, False
            logger.warning("joint step failed (%s); retrying its %d slots one by one", exc, len(parts))
        self.store.grads.zero_()
        width = 0
        for part in parts:
            try:
                batch = self._pack([part])
                width += int(batch.input_ids.shape[1])
                losses += self._forward_backward(batch)
            except Exception as exc:
                self.store.grads[part.slot].zero_()
                self._fail(part.slot, exc)
        return losses, data_s, width, False

    def _forward_backward(self, batch: PackedBatch) -> torch.Tensor:
        """One forward of ``batch``, per-slot loss normalised by the slot's own target count, one backward."""
        per_slot = self._loss_sums(batch, training=True) / batch.target_counts
        per_slot.sum().backward()  # the LoRA layers' backward adds dA / dB into store.grads
        return per_slot.detach()

    def _loss_sums(self, batch: PackedBatch, *, training: bool) -> torch.Tensor:
        """``(Z,)`` summed target-token losses of one forward (``lm_head`` chunks checkpointed in training)."""
        hidden = self._hidden(batch)
        return slot_loss_sums(
            hidden, self.lm_head, batch.targets, self.context, num_slots=len(self.slots), checkpointed=training
        )

    def evaluate(self, slot: int) -> float | None:
        """Token-weighted mean loss on the slot's validation rows (no dropout); ``None`` without any.

        A loss below the best so far (NaN never is) makes the current adapter the slot's best.
        """
        return self.evaluate_slots([slot])[slot]

    @torch.no_grad()
    def evaluate_slots(self, slots: list[int]) -> dict[int, float | None]:
        """``evaluate`` of several slots at once: their validation rows go through the model together, in
        packed forwards of up to ``EVAL_MAX_TOKENS`` tokens (no per-trial loop; one device sync at the end)."""
        states = {slot: self.state(slot) for slot in slots}
        totals = torch.zeros(len(self.slots), dtype=torch.float64, device=self.device)
        n_targets = dict.fromkeys(slots, 0)
        for parts in self._validation_forwards(slots):
            batch = self._pack(parts)
            totals += self._loss_sums(batch, training=False).double()
            for slot, n in batch.n_targets.items():
                n_targets[slot] += n
        values = totals.tolist()  # device sync
        losses: dict[int, float | None] = {}
        for slot, state in states.items():
            if not state.val:
                losses[slot] = None
                continue
            loss = losses[slot] = values[slot] / n_targets[slot]
            if loss == loss and (state.best_val_loss is None or loss < state.best_val_loss):
                state.best_val_loss, state.best_step = loss, state.steps_done
                state.best = self.store.read(self.store.weights, slot)
        return losses

    def _validation_forwards(self, slots: list[int]) -> list[list[SlotRows]]:
        """The slots' validation rows grouped into the packed forwards ``evaluate_slots`` runs."""
        return _eval_forwards([(slot, self.state(slot).val) for slot in slots], EVAL_MAX_TOKENS)

    def evaluation_passes(self, slots: list[int]) -> int:
        """The forwards ``evaluate_slots(slots)`` runs."""
        return len(self._validation_forwards(slots))

    @torch.no_grad()
    def greedy_matches(self, slot: int, examples: list[Example], batch_size: int = 64) -> list[bool]:
        """Whether the slot's current adapter reproduces each example's targets under greedy decoding: every
        target token is the argmax of the logits before it (teacher-forced, so one forward per batch; the
        end-of-turn token is a target, so a completion that runs on does not match)."""
        self.state(slot)
        matches: list[bool] = []
        for start in range(0, len(examples), batch_size):
            batch = self._pack([SlotRows(slot, examples[start : start + batch_size])])
            hidden = self._hidden(batch)
            picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.targets.positions)
            correct = torch.empty(len(picked), dtype=torch.bool, device=self.device)
            for chunk in batch.targets.chunks:
                with self.context.routed(chunk.routing):
                    logits = self.lm_head(picked[chunk.start : chunk.end])
                correct[chunk.start : chunk.end] = logits.argmax(-1) == batch.targets.labels[chunk.start : chunk.end]
            wrong = torch.zeros(batch.n_rows, dtype=torch.int64, device=self.device)
            wrong.index_add_(0, batch.targets.rows, (~correct).long())
            matches.extend(bool(w == 0) for w in wrong.tolist())
        return matches

    @torch.no_grad()
    def generate(
        self, prompts: dict[int, list[list[int]]], *, max_new_tokens: int, stop_ids: frozenset[int]
    ) -> dict[int, list[list[int]]]:
        """Greedy continuations of each slot's prompts under the slot's current adapter: every row of every slot
        in one packed forward per new token (no KV cache: each forward runs the rows so far, which for short
        answers on validation-sized sets costs less than keeping a cache per slot). A row ends at a token of
        ``stop_ids`` (not included) or after ``max_new_tokens``. In a pack over several GPUs every rank calls it
        at the same point, with no prompts where it has none to answer: the ranks agree on each new token's
        forwards (the module docstring of worker/engine/distributed.py).

        Returns:
            ``{slot: [new token ids per prompt]}``, in the prompts' order.
        """
        for slot in prompts:
            self.state(slot)
        answers: dict[int, list[list[int]]] = {slot: [[] for _ in rows] for slot, rows in prompts.items()}
        open_rows = [(slot, i) for slot in sorted(prompts) for i in range(len(prompts[slot])) if prompts[slot][i]]
        lockstep = self.lockstep
        if lockstep is not None:
            max_new_tokens = lockstep.most(max_new_tokens if open_rows else 0)
        for _ in range(max_new_tokens):
            groups = _token_groups(open_rows, lambda r: len(prompts[r[0]][r[1]]) + len(answers[r[0]][r[1]]) + 1,
                                   EVAL_MAX_TOKENS) if open_rows else []
            passes = len(groups) if lockstep is None else lockstep.most(len(groups))
            if not passes:
                break
            tokens: list[int] = []
            for group in groups:
                tokens += self._next_tokens([(slot, prompts[slot][i] + answers[slot][i]) for slot, i in group])
            if lockstep is not None:
                lockstep.pad(self, "forward", passes - len(groups))
            still_open = []
            for (slot, i), token in zip(open_rows, tokens, strict=True):
                if token in stop_ids:
                    continue
                answers[slot][i].append(token)
                still_open.append((slot, i))
            open_rows = still_open
        return answers

    def _next_tokens(self, rows: list[tuple[int, list[int]]]) -> list[int]:
        """The greedy next token of each ``(slot, ids)`` row (rows grouped by slot), one packed forward."""
        # Each row gets a placeholder token with a label, so that its last real token is a loss target: the
        # targets' hidden states are exactly the rows' last positions, in row order.
        parts: dict[int, list[Example]] = {}
        for slot, ids in rows:
            parts.setdefault(slot, []).append(Example([*ids, self.pad_token_id], [IGNORE_INDEX] * len(ids) + [0]))
        batch = self._pack([SlotRows(slot, examples) for slot, examples in parts.items()])
        hidden = self._hidden(batch)
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.targets.positions)
        tokens = torch.empty(len(picked), dtype=torch.int64, device=self.device)
        for chunk in batch.targets.chunks:
            with self.context.routed(chunk.routing):
                tokens[chunk.start : chunk.end] = self.lm_head(picked[chunk.start : chunk.end]).argmax(-1)
        return [int(t) for t in tokens.tolist()]  # one device sync per forward

    @property
    def answer_stop_ids(self) -> frozenset[int]:
        """The tokens that end a generated answer: the tokenizer's eos and the model's generation eos (the chat
        template's end of turn, where the model says)."""
        ids = {self.tokenizer.eos_token_id}
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids |= set(configured) if isinstance(configured, list | tuple) else {configured}
        return frozenset(int(i) for i in ids if i is not None)

    def use_best(self, slot: int) -> None:
        """Make the slot's best-validation adapter its current weights (for a trial that is finishing: scoring it
        by generation then uses the adapter it will be exported with); nothing without a best."""
        state = self.state(slot)
        if state.best is not None:
            self.store.install(slot, state.best)

    # -- artifacts -----------------------------------------------------------------------------------

    def adapter(self, slot: int) -> ModuleTensors:
        """Clones of the slot's current ``{path: (A (r, d_in), B (d_out, r))}`` (true rank)."""
        self.state(slot)
        return self.store.read(self.store.weights, slot)

    def checkpoint(self, slot: int, directory: Path) -> Path:
        """Save everything needed to resume the slot exactly (``admit(spec, resume=directory)``)."""
        return self.prepare_checkpoint(slot, directory)()

    def prepare_checkpoint(self, slot: int, directory: Path) -> Callable[[], Path]:
        """``checkpoint`` in two halves: this call snapshots the slot now (device clones); the function it
        returns writes that snapshot to ``directory`` and may run later, on another thread."""
        state, store, optimizer = self.state(slot), self.store, self.optimizer
        snapshot = checkpoint.snapshot_slot(slot=slot, state=state, store=store, optimizer=optimizer)
        return lambda: snapshot.write(directory)

    def export(self, slot: int, directory: Path, *, base_model_name: str) -> Path:
        """Write the slot's best-validation adapter (the current one if it has none) in PEFT format."""
        return self.prepare_export(slot, directory, base_model_name=base_model_name)()

    def prepare_export(self, slot: int, directory: Path, *, base_model_name: str) -> Callable[[], Path]:
        """``export`` in two halves, as ``prepare_checkpoint``: what to write is fixed now, the files later."""
        state = self.state(slot)
        tensors = state.best if state.best is not None else self.adapter(slot)
        config, targets = state.config, peft_target_modules(self.model, state.paths)
        return lambda: export_peft_adapter(
            directory, tensors, config=config, target_modules=targets, base_model_name=base_model_name
        )

    def close(self) -> None:
        """Unwrap the model's layers: it is the bare frozen base model again, ready for the next pack."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self._restore_model()
        self.slots = [None] * len(self.slots)
        self._prefetched = None

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
        self._prefetched = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def __enter__(self) -> PackEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------------

    @property
    def lm_head(self) -> torch.nn.Module:
        """The output projection (LoRA-wrapped where a slot targets it), soft-capped where the model caps."""
        head = self.model.get_output_embeddings()
        assert isinstance(head, torch.nn.Module), f"{type(self.model).__name__} has no output embeddings"
        return head if self.logit_softcap is None else SoftCappedHead(head, self.logit_softcap)

    def _hidden(self, batch: PackedBatch) -> torch.Tensor:
        """``(1, tokens, hidden)``: the decoder's last hidden states of the packed stream, LoRA-routed."""
        with self.context.routed(batch.routing):
            return self.model.base_model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                **batch.attention_kwargs(),
            ).last_hidden_state

    def idle_pass(self, *, train: bool) -> None:
        """One pass of a single pad token through the bare base (no slot's adapter), and its backward with
        ``train``: what a rank of a pack over several GPUs runs to take part in the sharded layers' collectives
        when it has fewer passes to run than the others (worker/engine/distributed.py). It changes nothing."""
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        bounds = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        with torch.set_grad_enabled(train):
            embeds = self.model.get_input_embeddings()(ids).detach().requires_grad_(train)
            hidden = self.model.base_model(
                inputs_embeds=embeds, position_ids=torch.zeros_like(ids), use_cache=False, cu_seq_lens_q=bounds,
                cu_seq_lens_k=bounds, max_length_q=1, max_length_k=1,
            ).last_hidden_state
            if train:
                hidden.sum().backward()

    def _restore_model(self) -> None:
        _restore(self.model)
        unfuse(self.model)
        self.model.config._attn_implementation = self._base_attention

    def _encode(self, rows: list[dict[str, Any]], max_seq_len: int) -> list[Example]:
        """Tokenised rows, shared by every trial of the pack with the same data and length: the trials of
        one task tokenise their dataset once, not once each (32 trials took seconds per pack start)."""
        key = (hashlib.sha1(json.dumps(rows, sort_keys=True).encode()).hexdigest(), max_seq_len)
        if key not in self._encodings:
            while len(self._encodings) >= MAX_ENCODED_DATASETS:  # the oldest goes: an engine lives across packs
                del self._encodings[next(iter(self._encodings))]
            self._encodings[key] = encode_rows(rows, self.tokenizer, max_seq_len)
        return self._encodings[key]

    def _pack(self, parts: list[SlotRows], *, static_shapes: bool = False) -> PackedBatch:
        return pack_rows(
            parts,
            pad_token_id=self.pad_token_id,
            num_slots=len(self.slots),
            device=self.device,
            loss_chunk=self.loss_chunk_tokens,
            pad_to_multiple=self._width_multiple,
            static_shapes=static_shapes,
        )

    @property
    def _width_multiple(self) -> int:
        return CUDA_WIDTH_MULTIPLE if self.device.type == "cuda" else 1

    def _fail(self, slot: int, exc: BaseException) -> None:
        state = self.state(slot)
        logger.warning("trial %s failed at step %d: %s", state.spec.trial_id, state.steps_done + 1, exc)
        state.failed = True
        self.failures[state.spec.trial_id] = f"{type(exc).__name__}: {exc}"


def _token_groups(rows: list[Any], length: Callable[[Any], int], max_tokens: int) -> list[list[Any]]:
    """``rows`` in order, cut into consecutive groups of at most ``max_tokens`` tokens (a longer row alone)."""
    groups: list[list[Any]] = [[]]
    used = 0
    for row in rows:
        n = length(row)
        if groups[-1] and used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(row)
        used += n
    return [g for g in groups if g]


def _eval_forwards(rows: list[tuple[int, list[Example]]], max_tokens: int) -> list[list[SlotRows]]:
    """The slots' validation rows cut into forwards of at most ``max_tokens`` tokens (a longer row alone),
    each a list of per-slot parts in slot order."""
    forwards: list[list[SlotRows]] = []
    current: list[SlotRows] = []
    size = 0
    for slot, examples in rows:
        start = 0
        for i, example in enumerate(examples):
            if size and size + len(example.input_ids) > max_tokens:
                if i > start:
                    current.append(SlotRows(slot, examples[start:i]))
                forwards.append(current)
                current, size, start = [], 0, i
            size += len(example.input_ids)
        if len(examples) > start:
            current.append(SlotRows(slot, examples[start:]))
    if current:
        forwards.append(current)
    return forwards
