"""One forward's input for the whole pack, assembled on the host and moved to the device once.

Each slot contributes its own micro-batch; rows go slot by slot and are right-padded to the longest row,
so slot ``z``'s tokens are one contiguous segment of the flattened ``(rows * seq)`` token axis. From the
padded batch the host derives, once per forward, everything the device needs: the LoRA routing of every
token, the dropout keys, and which hidden states feed the loss (target positions, grouped by slot, cut
into chunks with their own routing for an adapted ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import DropoutKeys, build_segments, keep_threshold, mix32
from kernels.dropout import MASK32
from worker.engine.data import IGNORE_INDEX, Example, collate
from worker.engine.lora import TokenRouting


@dataclass(frozen=True)
class SlotRows:
    """One slot's micro-batch. ``dropout`` 0 means none (always so in evaluation)."""

    slot: int
    examples: Sequence[Example]
    dropout: float = 0.0
    dropout_key: int = 0  # see ``dropout_key()``


@dataclass(frozen=True)
class LossChunk:
    """Targets ``[start, end)`` of ``LossTargets`` and the LoRA routing of their hidden states."""

    start: int
    end: int
    routing: TokenRouting


@dataclass(frozen=True)
class LossTargets:
    """The positions whose next token is a target, in token order (so grouped by slot); ``(targets,)`` each."""

    positions: torch.Tensor  # int64 rows of the flattened (rows * seq, hidden) hidden states
    labels: torch.Tensor  # int64 token to predict
    slots: torch.Tensor  # int64 slot of each target
    chunks: tuple[LossChunk, ...]


@dataclass(frozen=True)
class PackedBatch:
    """A forward's device tensors plus host counts.

    Attributes:
        input_ids: ``(rows, seq)`` int64, right-padded.
        attention_mask: ``(rows, seq)`` int64.
        routing: LoRA routing of all ``rows * seq`` tokens.
        targets: what the loss reads.
        target_counts: ``(Z,)`` float32 targets per slot, 1 for slots without any (their sum is 0).
        n_targets: host copy, ``{slot: targets}`` for the slots in the batch.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    routing: TokenRouting
    targets: LossTargets
    target_counts: torch.Tensor
    n_targets: dict[int, int]


def dropout_key(seed: int, step: int) -> int:
    """32-bit key of a trial's dropout masks at one of its own steps (``seed``: its dropout stream)."""
    return mix32(mix32(mix32(seed & MASK32) ^ ((seed >> 32) & MASK32)) ^ (step & MASK32))


def pack_rows(
    parts: Sequence[SlotRows], *, pad_token_id: int, num_slots: int, device: torch.device, loss_chunk: int,
    pad_to_multiple: int = 1,
) -> PackedBatch:
    """Concatenate the slots' micro-batches and derive the forward's routing and loss targets.

    Args:
        parts: one entry per slot in the forward, each with at least one example; the order is the row order.
        pad_token_id: fills the padding.
        num_slots: ``Z``.
        device: where the forward runs.
        loss_chunk: targets per ``lm_head`` chunk of the loss.
        pad_to_multiple: the batch width is rounded up to a multiple of this (see ``collate``).
    """
    rows = [(part, i) for part in parts for i in range(len(part.examples))]
    host = collate([e for part in parts for e in part.examples], pad_token_id, pad_to_multiple)
    n_rows, seq = host.input_ids.shape
    # Right padding: nothing reads a padded position's output, so the LoRA kernels may skip it.
    real = host.attention_mask.sum(1).tolist()
    pads = [(r * seq + n, (r + 1) * seq) for r, n in enumerate(real) if n < seq]
    meta = build_segments(
        [p.slot for p in parts], [len(p.examples) * seq for p in parts], num_slots=num_slots, device=device,
        pad_spans=pads,
    )
    keys = _token_dropout(rows, seq) if any(p.dropout > 0 for p in parts) else None

    # Position t predicts token t + 1; only target tokens count.
    row_idx, pos = (host.labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    positions = row_idx * seq + pos
    labels = host.labels[row_idx, pos + 1]
    slots = torch.tensor([p.slot for p, _ in rows], dtype=torch.int64)[row_idx]
    counts = torch.bincount(slots, minlength=num_slots)
    chunks = []
    for start in range(0, len(positions), loss_chunk):
        end = min(start + loss_chunk, len(positions))
        run_slots, run_lengths = torch.unique_consecutive(slots[start:end], return_counts=True)
        chunk_meta = build_segments(run_slots.tolist(), run_lengths.tolist(), num_slots=num_slots, device=device)
        chunk_keys = None if keys is None else _select(keys, positions[start:end])
        chunks.append(LossChunk(start, end, TokenRouting(chunk_meta, _to_device(chunk_keys, device))))

    return PackedBatch(
        input_ids=host.input_ids.to(device, non_blocking=True),
        attention_mask=host.attention_mask.to(device, non_blocking=True),
        routing=TokenRouting(meta, _to_device(keys, device)),
        targets=LossTargets(
            positions=positions.to(device, non_blocking=True),
            labels=labels.to(device, non_blocking=True),
            slots=slots.to(device, non_blocking=True),
            chunks=tuple(chunks),
        ),
        target_counts=counts.clamp(min=1).to(torch.float32).to(device, non_blocking=True),
        n_targets={p.slot: int(counts[p.slot]) for p in parts},
    )


def _token_dropout(rows: list[tuple[SlotRows, int]], seq: int) -> DropoutKeys:
    """Host-side dropout keys of every token: hash(row key, position in the row).

    A row's key mixes the trial's step key with the row's index in the trial's own micro-batch, so a
    token's key (and its mask) is the same however the pack around it looks.
    """
    row_keys = torch.tensor([mix32(part.dropout_key ^ i) for part, i in rows], dtype=torch.int64)
    token_keys = mix32(row_keys[:, None] ^ torch.arange(seq, dtype=torch.int64)[None, :]).reshape(-1)
    threshold = torch.tensor([keep_threshold(part.dropout) for part, _ in rows], dtype=torch.int64)
    inv_keep = torch.tensor([1.0 / (1.0 - part.dropout) for part, _ in rows], dtype=torch.float64)
    return DropoutKeys(
        token_keys=token_keys,
        threshold=threshold.repeat_interleave(seq),
        inv_keep=inv_keep.to(torch.float32).repeat_interleave(seq),
    )


def _select(keys: DropoutKeys, index: torch.Tensor) -> DropoutKeys:
    return DropoutKeys(keys.token_keys[index], keys.threshold[index], keys.inv_keep[index])


def _to_device(keys: DropoutKeys | None, device: torch.device) -> DropoutKeys | None:
    if keys is None:
        return None
    return DropoutKeys(*(t.to(device, non_blocking=True) for t in (keys.token_keys, keys.threshold, keys.inv_keep)))
