"""Per-slot next-token loss without materialising the full logits.

Only the hidden states whose next token is a target go through ``lm_head``, a chunk of targets at a time;
in training each chunk runs under ``torch.utils.checkpoint``, so the forward keeps no logits at all and
the backward holds one chunk's ``(chunk, vocab)`` logits at a time (with a 128k vocabulary and 16k target
tokens the full fp32 logits alone would take 8 GiB).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from worker.engine.batch import LossTargets
from worker.engine.data import IGNORE_INDEX
from worker.engine.lora import LoraContext, TokenRouting


class SoftCappedHead(nn.Module):
    """``cap * tanh(head(h) / cap)``: the output projection with Gemma 2's final logit soft cap
    (``final_logit_softcapping``), as its ``ForCausalLM.forward`` applies it to the logits."""

    def __init__(self, head: nn.Module, cap: float) -> None:
        super().__init__()
        self.head, self.cap = head, cap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(h) / self.cap) * self.cap


def slot_loss_sums(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: LossTargets,
    context: LoraContext,
    *,
    num_slots: int,
    checkpointed: bool,
) -> torch.Tensor:
    """Summed fp32 cross-entropy of each slot's target tokens.

    Args:
        hidden: ``(rows, seq, hidden)`` last hidden states of the decoder (after its final norm).
        lm_head: the output projection, possibly a ``StackedLoraLinear``.
        targets: target positions, labels, slots and chunks with their ``lm_head`` routing.
        context: the model's LoRA context, routed per chunk while ``lm_head`` runs.
        num_slots: ``Z``.
        checkpointed: recompute each chunk's logits in backward instead of keeping them (training).

    Returns:
        ``(Z,)`` float32: ``sum over slot z's targets of -log p(target)``; 0 for slots without targets.
    """
    return _loss_sums(hidden, lm_head, targets, context, targets.slots, num_slots, checkpointed)


def row_loss_sums(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: LossTargets,
    context: LoraContext | None,
    *,
    num_rows: int,
    checkpointed: bool,
) -> torch.Tensor:
    """``slot_loss_sums`` summed by row instead of by slot: ``(num_rows,)`` float32, each example's summed
    cross-entropy, the negative of its targets' log-probability under its slot's adapter (what DPO compares:
    worker/engine/dpo.py); with ``context`` None, ``lm_head`` runs unrouted (no adapter)."""
    return _loss_sums(hidden, lm_head, targets, context, targets.rows, num_rows, checkpointed)


def _loss_sums(hidden: torch.Tensor, lm_head: nn.Module, targets: LossTargets, context: LoraContext | None,
               index: torch.Tensor, size: int, checkpointed: bool) -> torch.Tensor:
    """The targets' cross-entropy summed into ``size`` bins by ``index`` (each target's slot or row)."""
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets.positions)  # (targets, hidden)
    sums = torch.zeros(size, dtype=torch.float32, device=hidden.device)
    for chunk in targets.chunks:
        h, labels = picked[chunk.start : chunk.end], targets.labels[chunk.start : chunk.end]
        if checkpointed:
            # No RNG inside (dropout masks are hashed), so there is no RNG state to stash and restore.
            ce = checkpoint(
                _chunk_ce, lm_head, context, chunk.routing, h, labels, use_reentrant=False, preserve_rng_state=False
            )
        else:
            ce = _chunk_ce(lm_head, context, chunk.routing, h, labels)
        sums = sums.index_add(0, index[chunk.start : chunk.end], ce)
    return sums


def target_token_loss(
    hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module, *, chunk: int = 4096
) -> torch.Tensor:
    """Mean next-token cross-entropy over the target tokens of one batch, chunked and checkpointed alike.

    The single-trial form of ``slot_loss_sums`` for callers outside the engine (a frozen-model baseline,
    a reference implementation); ``lm_head`` runs with no LoRA routing.

    Args:
        hidden: ``(rows, seq, hidden)`` last hidden states.
        labels: ``(rows, seq)``, ``IGNORE_INDEX`` where there is no target; position t predicts t + 1.
        lm_head: the output projection.
        chunk: targets per ``lm_head`` chunk.

    Returns:
        A scalar fp32 tensor. Finding the targets on the device syncs with it once.
    """
    rows, positions = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    picked, targets = hidden[rows, positions], labels[rows, positions + 1]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, len(targets), chunk):
        h, y = picked[start : start + chunk], targets[start : start + chunk]
        ce = checkpoint(_chunk_ce, lm_head, None, None, h, y, use_reentrant=False, preserve_rng_state=False)
        total = total + ce.sum()
    return total / max(1, len(targets))


def _chunk_ce(
    lm_head: nn.Module,
    context: LoraContext | None,
    routing: TokenRouting | None,
    h: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """``(chunk,)`` fp32 cross-entropy of ``h`` ``(chunk, hidden)`` against ``labels`` ``(chunk,)``."""
    if context is None:
        return F.cross_entropy(lm_head(h).float(), labels, reduction="none")
    with context.routed(routing):  # set again when backward recomputes this chunk
        logits = lm_head(h)
    return F.cross_entropy(logits.float(), labels, reduction="none")
