"""One forward's input for the whole pack, assembled on the host and moved to the device once.

Each slot contributes its own micro-batch; its rows go end to end into one token stream, slot by slot,
with no padding between them (sequence packing): slot ``z``'s tokens are one contiguous segment of the
stream, position ids restart at 0 with every row and attention never crosses a row (``attention.py``).
From the stream the host derives, once per forward, everything the device needs: the LoRA routing of every
token, the dropout keys, the row boundaries, and which hidden states feed the loss (target positions,
grouped by slot, cut into chunks with their own routing for an adapted ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import DropoutKeys, SegmentMeta, build_segments, build_slot_segments, keep_threshold, mix32
from kernels.dropout import MASK32
from kernels.segments import upload
from worker.engine.data import IGNORE_INDEX, Example
from worker.engine.lora import TokenRouting

# With static shapes, the longest row is rounded up to this: the variable-length attention's launch grid (blocks
# of 128 query rows) depends on it, so it is part of a captured step's shape. Padding rows are no longer.
ROW_LENGTH_MULTIPLE = 128
# With static shapes, the loss's targets are padded to a shape bucket that is a multiple of this: their count
# varies more from step to step than the tokens' (relatively), and a coarser bucket keeps the graphs few.
TARGET_MULTIPLE = 256


@dataclass(frozen=True)
class SlotRows:
    """One slot's micro-batch. ``dropout`` 0 means none (always so in evaluation)."""

    slot: int
    examples: Sequence[Example]
    dropout: float = 0.0
    dropout_key: int = 0  # see ``dropout_key()``
    # The slot's data items the examples came from, in order (a DPO trial's pairs: its reference log-probabilities
    # are cached by them); empty where nothing needs them.
    items: tuple[int, ...] = ()


@dataclass(frozen=True)
class LossChunk:
    """Targets ``[start, end)`` of ``LossTargets`` and the LoRA routing of their hidden states."""

    start: int
    end: int
    routing: TokenRouting


@dataclass(frozen=True)
class LossTargets:
    """The positions whose next token is a target, in token order (so grouped by slot); ``(targets,)`` each."""

    positions: torch.Tensor  # int64 positions in the stream (rows of the flattened (tokens, hidden) states)
    labels: torch.Tensor  # int64 token to predict
    slots: torch.Tensor  # int64 slot of each target
    rows: torch.Tensor  # int64 row (in the batch's row order) of each target
    chunks: tuple[LossChunk, ...]


@dataclass(frozen=True)
class PackedBatch:
    """A forward's device tensors plus host counts.

    Attributes:
        input_ids: ``(1, tokens)`` int64, the rows end to end (then padding up to the width multiple, as
            one more row that nothing reads).
        position_ids: ``(1, tokens)`` int64, each row's own positions ``0 .. len - 1``.
        cu_seqlens: ``(rows + 1,)`` int32 row boundaries, the padding row included.
        max_row_len: the longest row.
        n_rows: the examples in the batch (the padding row not counted).
        routing: LoRA routing of all tokens.
        targets: what the loss reads.
        target_counts: ``(Z,)`` float32 targets per slot, 1 for slots without any (their sum is 0).
        n_targets: host copy, ``{slot: targets}`` for the slots in the batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_row_len: int
    n_rows: int
    routing: TokenRouting
    targets: LossTargets
    target_counts: torch.Tensor
    n_targets: dict[int, int]

    def shape_key(self) -> tuple[int, ...]:
        """What the shapes of this batch's tensors depend on (with ``static_shapes``, all they depend on):
        tokens, row boundaries, longest row, targets, loss chunks, dropout or not."""
        has_dropout = int(self.routing.dropout is not None)
        return (self.input_ids.shape[1], self.cu_seqlens.shape[0], self.max_row_len, self.targets.labels.shape[0],
                len(self.targets.chunks), has_dropout)  # fmt: skip

    def attention_kwargs(self) -> dict[str, object]:
        """The model's keyword arguments that carry the row boundaries down to ``packed_attention``."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_row_len,
            "max_length_k": self.max_row_len,
        }


def dropout_key(seed: int, step: int) -> int:
    """32-bit key of a trial's dropout masks at one of its own steps (``seed``: its dropout stream)."""
    return mix32(mix32(mix32(seed & MASK32) ^ ((seed >> 32) & MASK32)) ^ (step & MASK32))


def pack_rows(
    parts: Sequence[SlotRows],
    *,
    pad_token_id: int,
    num_slots: int,
    device: torch.device,
    loss_chunk: int,
    pad_to_multiple: int = 1,
    static_shapes: bool = False,
) -> PackedBatch:
    """Lay the slots' micro-batches end to end in one stream and derive the forward's routing and targets.

    Args:
        parts: one entry per slot in the forward, each with at least one example; the order is the row order.
        pad_token_id: fills the padding.
        num_slots: ``Z``.
        device: where the forward runs.
        loss_chunk: targets per ``lm_head`` chunk of the loss.
        pad_to_multiple: the stream's length is rounded up to a multiple of this (a bounded set of shapes).
        static_shapes: make every tensor's shape depend only on a few buckets (``shape_bucket``), never on
            which slots are in the batch, so that a step captured in a CUDA graph replays on any batch of
            the same ``shape_key``: the stream and the targets padded to their buckets (padding targets are
            ignored labels of the last slot), the stream's padding as a fixed number of rows of at most
            ``ROW_LENGTH_MULTIPLE`` tokens (some may be empty), the longest row rounded up to that, one LoRA
            segment per slot (``build_slot_segments``); the parts go in slot order. The losses and gradients
            are the same.
    """
    if static_shapes:
        parts = sorted(parts, key=lambda part: part.slot)  # one segment per slot: slots in stream order
    rows = [(part, i) for part in parts for i in range(len(part.examples))]
    examples = [e for part in parts for e in part.examples]
    lengths = [len(e.input_ids) for e in examples]
    n_real = sum(lengths)
    # Padding after the real tokens, in rows of the last slot that nothing reads.
    n_tokens, pad_rows = _padding_rows(n_real, pad_to_multiple, static_shapes)
    row_lengths = lengths + pad_rows
    input_ids, labels, position_ids, row_of_token, ends = _token_tensors(
        examples, row_lengths, n_tokens, n_tokens - n_real, pad_token_id
    )
    meta = _stream_segments(parts, n_real, n_tokens, num_slots, device, static_shapes)
    keys = _token_dropout(rows, position_ids, row_of_token) if any(p.dropout > 0 for p in parts) else None
    positions, target_rows, slots, target_labels, counts = _loss_targets(
        labels, position_ids, row_of_token, rows, len(row_lengths), num_slots, static_shapes
    )
    chunks = _loss_chunks(positions, slots, keys, loss_chunk, num_slots, device, static_shapes)
    max_row_len = max(row_lengths)
    if static_shapes:
        max_row_len = -(-max_row_len // ROW_LENGTH_MULTIPLE) * ROW_LENGTH_MULTIPLE
    return PackedBatch(
        input_ids=upload(input_ids[None], device),
        position_ids=upload(position_ids[None], device),
        cu_seqlens=upload(torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32), device),
        max_row_len=max_row_len,
        n_rows=len(examples),
        routing=TokenRouting(meta, _to_device(keys, device)),
        targets=LossTargets(
            positions=upload(positions, device),
            labels=upload(target_labels, device),
            slots=upload(slots, device),
            rows=upload(target_rows, device),
            chunks=chunks,
        ),
        target_counts=upload(counts.clamp(min=1).to(torch.float32), device),
        n_targets={p.slot: int(counts[p.slot]) for p in parts},
    )


def _padding_rows(n_real: int, pad_to_multiple: int, static_shapes: bool) -> tuple[int, list[int]]:
    """The stream's length (``pad_to_multiple``, ``static_shapes``: see ``pack_rows``) and the lengths of the
    padding rows after its ``n_real`` real tokens."""
    if static_shapes:  # as many rows as the bucket's size says, each of at most ROW_LENGTH_MULTIPLE tokens
        n_tokens = shape_bucket(n_real, pad_to_multiple)
        tail = n_tokens - n_real  # < the bucket's step
        count = -(-_bucket_step(n_tokens, pad_to_multiple) // ROW_LENGTH_MULTIPLE)
        return n_tokens, [tail // count + (i < tail % count) for i in range(count)]
    # One row, up to the width multiple.
    n_tokens = -(-n_real // pad_to_multiple) * pad_to_multiple
    tail = n_tokens - n_real
    return n_tokens, [tail] if tail else []


def _token_tensors(
    examples: list[Example], row_lengths: list[int], n_tokens: int, tail: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream's tokens, labels and position ids (the ``tail`` padding tokens after the examples'), the row
    of each token, and each row's end; ``(tokens,)`` each but the ends, ``(rows,)``."""
    ends = torch.tensor(row_lengths, dtype=torch.int64).cumsum(0)
    starts = ends - torch.tensor(row_lengths, dtype=torch.int64)
    # One tensor per field from flat lists: a tensor per row costs ~30 us each on the host.
    input_ids = torch.tensor([t for e in examples for t in e.input_ids] + [pad_token_id] * tail, dtype=torch.int64)
    labels = torch.tensor([t for e in examples for t in e.labels] + [IGNORE_INDEX] * tail, dtype=torch.int64)
    row_of_token = torch.repeat_interleave(torch.arange(len(row_lengths)), torch.tensor(row_lengths))
    position_ids = torch.arange(n_tokens) - starts[row_of_token]
    return input_ids, labels, position_ids, row_of_token, ends


def _stream_segments(
    parts: Sequence[SlotRows], n_real: int, n_tokens: int, num_slots: int, device: torch.device, static_shapes: bool
) -> SegmentMeta:
    """The LoRA routing of the stream's tokens: each part's tokens are its slot's segment (``static_shapes``: one
    segment per slot, in slot order, empty or not); the padding after ``n_real`` goes with the last."""
    tail = n_tokens - n_real
    slot_tokens = [sum(len(e.input_ids) for e in part.examples) for part in parts]
    pad_spans = [(n_real, n_tokens)] if tail else []
    if static_shapes:
        per_slot = [0] * num_slots
        for part, n in zip(parts, slot_tokens, strict=True):
            per_slot[part.slot] += n
        per_slot[-1] += tail  # the padding row goes with the last slot (after every real token)
        return build_slot_segments(per_slot, device=device, pad_spans=pad_spans)
    slot_tokens[-1] += tail
    return build_segments([p.slot for p in parts], slot_tokens, num_slots=num_slots, device=device,
                          pad_spans=pad_spans)  # fmt: skip


def _loss_targets(
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    row_of_token: torch.Tensor,
    rows: list[tuple[SlotRows, int]],
    n_rows: int,
    num_slots: int,
    static_shapes: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss's targets in token order: their positions, rows (of the ``n_rows``, padding included), slots and
    labels (with ``static_shapes``, padded to their bucket), and the real targets' count per slot, ``(Z,)``."""
    n_tokens = labels.shape[0]
    # Position t predicts token t + 1 of the same row; only target tokens count.
    predicts = torch.zeros(n_tokens, dtype=torch.bool)
    predicts[:-1] = (labels[1:] != IGNORE_INDEX) & (position_ids[1:] != 0)
    positions = predicts.nonzero().squeeze(1)
    target_rows = row_of_token[positions]
    slots = torch.tensor([p.slot for p, _ in rows], dtype=torch.int64)[target_rows]
    counts = torch.bincount(slots, minlength=num_slots)
    target_labels = labels[positions + 1]
    if static_shapes:  # ignored targets of the last slot: they add 0 to its loss and nothing to any gradient
        extra = shape_bucket(len(positions), TARGET_MULTIPLE) - len(positions)
        positions = torch.cat([positions, torch.full((extra,), n_tokens - 1)])
        target_rows = torch.cat([target_rows, torch.full((extra,), n_rows - 1)])
        slots = torch.cat([slots, torch.full((extra,), num_slots - 1)])
        target_labels = torch.cat([target_labels, torch.full((extra,), IGNORE_INDEX)])
    return positions, target_rows, slots, target_labels, counts


def _loss_chunks(
    positions: torch.Tensor,
    slots: torch.Tensor,
    keys: DropoutKeys | None,
    loss_chunk: int,
    num_slots: int,
    device: torch.device,
    static_shapes: bool,
) -> tuple[LossChunk, ...]:
    """The targets cut into chunks of ``loss_chunk``, each with the LoRA routing (and dropout keys) of its
    hidden states for an adapted ``lm_head``."""
    chunks = []
    for start in range(0, len(positions), loss_chunk):
        end = min(start + loss_chunk, len(positions))
        chunk_meta = _chunk_segments(slots[start:end], num_slots, device, static_shapes)
        chunk_keys = None if keys is None else _select(keys, positions[start:end])
        chunks.append(LossChunk(start, end, TokenRouting(chunk_meta, _to_device(chunk_keys, device))))
    return tuple(chunks)


def shape_bucket(n: int, multiple: int) -> int:
    """``n`` rounded up to one of 16 sizes per power of two (at most ``n / 16`` more) that are multiples of
    ``multiple``: the few sizes that steps of varying length share."""
    step = _bucket_step(n, multiple)
    return max(multiple, -(-n // step) * step)


def _bucket_step(n: int, multiple: int) -> int:
    """The spacing of ``shape_bucket``'s sizes around ``n``: ``n / 32`` to ``n / 16``, a multiple of ``multiple``."""
    step = max(multiple, 2 ** max(0, n.bit_length() - 5))
    return -(-step // multiple) * multiple


def _chunk_segments(slots: torch.Tensor, num_slots: int, device: torch.device, static_shapes: bool) -> SegmentMeta:
    """The LoRA routing of one loss chunk's targets (``slots``: each target's slot, in slot order)."""
    if static_shapes:
        return build_slot_segments(torch.bincount(slots, minlength=num_slots).tolist(), device=device)
    run_slots, run_lengths = torch.unique_consecutive(slots, return_counts=True)
    return build_segments(run_slots.tolist(), run_lengths.tolist(), num_slots=num_slots, device=device)


def _token_dropout(
    rows: list[tuple[SlotRows, int]], position_ids: torch.Tensor, row_of_token: torch.Tensor
) -> DropoutKeys:
    """Host-side dropout keys of every token: hash(row key, position in the row).

    A row's key mixes the trial's step key with the row's index in the trial's own micro-batch, so a
    token's key (and its mask) is the same however the pack around it looks. Padding rows get key 0
    and the last row's threshold (their values are never read).
    """
    row_keys = torch.tensor([mix32(part.dropout_key ^ i) for part, i in rows] + [0], dtype=torch.int64)
    threshold = torch.tensor([keep_threshold(part.dropout) for part, _ in rows], dtype=torch.int64)
    inv_keep = torch.tensor([1.0 / (1.0 - part.dropout) for part, _ in rows], dtype=torch.float64)
    row = row_of_token.clamp(max=len(rows) - 1)
    return DropoutKeys(
        token_keys=mix32(row_keys[row_of_token.clamp(max=len(rows))] ^ position_ids),
        threshold=threshold[row],
        inv_keep=inv_keep.to(torch.float32)[row],
    )


def _select(keys: DropoutKeys, index: torch.Tensor) -> DropoutKeys:
    return DropoutKeys(keys.token_keys[index], keys.threshold[index], keys.inv_keep[index])


def _to_device(keys: DropoutKeys | None, device: torch.device) -> DropoutKeys | None:
    if keys is None:
        return None
    return DropoutKeys(*(upload(t, device) for t in (keys.token_keys, keys.threshold, keys.inv_keep)))


def cut_forwards(rows: list[tuple[int, list[Example]]], max_tokens: int) -> list[list[SlotRows]]:
    """The slots' rows cut into forwards (no backward) of at most ``max_tokens`` tokens (a longer row alone),
    each a list of per-slot parts in slot order; a slot's rows keep their order across the forwards."""
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
