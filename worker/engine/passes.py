"""``ModelPasses``: the passes of a packed token stream through the LoRA-wrapped base model.

Every part of the engine runs its work through these: the training step (``forward_backward``), validation
(``loss_sums`` without a backward), generation (``hidden`` and ``lm_head``) and a rank's idle pass in a pack over
several GPUs (``idle_pass``). Each slot's adapter applies to its own rows only (``LoraContext.routed``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from worker.engine.batch import PackedBatch, SlotRows, pack_rows
from worker.engine.lora import LoraContext
from worker.engine.loss import SoftCappedHead, row_loss_sums, slot_loss_sums

# On CUDA, the packed stream's length is rounded up to this: fewer distinct GEMM shapes for cuBLAS to plan, at
# most 63 tokens of padding a step (on the CPU there is nothing to gain, and exact lengths keep the tests' numbers).
CUDA_WIDTH_MULTIPLE = 64

LOSS_CHUNK_TOKENS = 4096  # target tokens per lm_head chunk: bounds the (chunk, vocab) logits of the loss
# Tokens per forward with no backward (validation, generation): no activations are kept for a backward, so a
# forward holds one layer's intermediates at a time; as large as a training step of a full pack, and bounded.
EVAL_MAX_TOKENS = 32768


class ModelPasses:
    """Forwards (and the training backward) of packed batches over ``num_slots`` slots on ``model``.

    Args:
        model: the frozen base model, its layers already wrapped for LoRA (``inject_lora`` with ``context``).
        context: the wrapped layers' routing of rows to slots.
        pad_token_id: what fills a stream's padding and an idle pass.
        num_slots: the engine's slots (``Z``): the per-slot losses are ``(Z,)``.
        device: where the batches go.
        loss_chunk_tokens: target tokens per ``lm_head`` chunk of the loss.
    """

    def __init__(self, model: PreTrainedModel, context: LoraContext, *, pad_token_id: int, num_slots: int,
                 device: torch.device, loss_chunk_tokens: int = LOSS_CHUNK_TOKENS) -> None:  # fmt: skip
        self.model, self.context = model, context
        self.pad_token_id, self.num_slots, self.device = pad_token_id, num_slots, device
        self.loss_chunk_tokens = loss_chunk_tokens
        cap = getattr(model.config, "final_logit_softcapping", None)
        self.logit_softcap = float(cap) if cap else None  # Gemma 2: the loss caps the logits as the model does

    def pack(self, parts: list[SlotRows], *, static_shapes: bool = False) -> PackedBatch:
        """The slots' rows as one packed stream on the device (``batch.pack_rows``)."""
        return pack_rows(
            parts,
            pad_token_id=self.pad_token_id,
            num_slots=self.num_slots,
            device=self.device,
            loss_chunk=self.loss_chunk_tokens,
            pad_to_multiple=CUDA_WIDTH_MULTIPLE if self.device.type == "cuda" else 1,
            static_shapes=static_shapes,
        )

    @property
    def lm_head(self) -> torch.nn.Module:
        """The output projection (LoRA-wrapped where a slot targets it), soft-capped where the model caps."""
        head = self.model.get_output_embeddings()
        assert isinstance(head, torch.nn.Module), f"{type(self.model).__name__} has no output embeddings"
        return head if self.logit_softcap is None else SoftCappedHead(head, self.logit_softcap)

    def hidden(self, batch: PackedBatch, *, adapters: bool = True) -> torch.Tensor:
        """``(1, tokens, hidden)``: the decoder's last hidden states of the packed stream, LoRA-routed (without
        ``adapters``: the bare base's, every slot's adapter off)."""
        with self.context.routed(batch.routing if adapters else None):
            return self.model.base_model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                **batch.attention_kwargs(),
            ).last_hidden_state

    def loss_sums(self, batch: PackedBatch, *, training: bool) -> torch.Tensor:
        """``(Z,)`` summed target-token losses of one forward (``lm_head`` chunks checkpointed in training)."""
        hidden = self.hidden(batch)
        return slot_loss_sums(
            hidden, self.lm_head, batch.targets, self.context, num_slots=self.num_slots, checkpointed=training
        )

    def row_loss_sums(self, batch: PackedBatch, *, training: bool) -> torch.Tensor:
        """``(rows,)`` each example's summed target-token loss under its slot's adapter (DPO's log-probabilities:
        worker/engine/dpo.py)."""
        hidden = self.hidden(batch)
        return row_loss_sums(hidden, self.lm_head, batch.targets, self.context, num_rows=_all_rows(batch),
                             checkpointed=training)[: batch.n_rows]

    @torch.no_grad()
    def reference_row_sums(self, batch: PackedBatch) -> torch.Tensor:
        """``row_loss_sums`` under the bare base, every adapter off: DPO's reference model is the frozen base
        itself, so its log-probabilities need no second model, and the rows of every slot share the pass."""
        hidden = self.hidden(batch, adapters=False)
        return row_loss_sums(hidden, self.lm_head, batch.targets, None, num_rows=_all_rows(batch),
                             checkpointed=False)[: batch.n_rows]

    def forward_backward(self, batch: PackedBatch) -> torch.Tensor:
        """One forward of ``batch``, per-slot loss normalised by the slot's own target count, one backward."""
        per_slot = self.loss_sums(batch, training=True) / batch.target_counts
        per_slot.sum().backward()  # the LoRA layers' backward adds dA / dB into store.grads
        return per_slot.detach()

    def forward_backward_rows(self, batch: PackedBatch,
                              slot_losses: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``forward_backward`` of a batch whose slots' losses are functions of each example's summed loss (a pack
        with DPO trials: worker/engine/dpo.py ``slot_losses``): ``slot_losses`` maps the ``(rows,)`` sums to
        ``(Z,)``."""
        per_slot = slot_losses(self.row_loss_sums(batch, training=True))
        per_slot.sum().backward()
        return per_slot.detach()

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


def _all_rows(batch: PackedBatch) -> int:
    """The stream's rows, its padding rows included: a batch of static shapes pads its targets with ignored ones in
    its last padding row (batch.py), which a sum by row must have a bin for (and then drops)."""
    return int(batch.cu_seqlens.shape[0]) - 1
