"""Token segments: which rows of the flattened token axis belong to which adapter slot.

Built once per step on the host and reused by every LoRA layer of that forward (vLLM's
``LoRAKernelMeta`` / ALTO's schedule table): layers never compute indices. A *segment* is a contiguous run
of rows of the flattened ``(tokens, d)`` activations that belongs to one slot; segments are laid end to end
from row 0 in the order given, so they tile ``[0, num_tokens)``.

Example: slots ``[2, 0]`` with lengths ``[3, 2]`` over 5 tokens::

    token:        0  1  2  3  4
    segment:      0  0  0  1  1      seg_slots = [2, 0]     offsets (ends) = [3, 5]
    token_slots:  2  2  2  0  0      max_len = 3, uniform = False, identity = False
    ragged grid (2 x 3): gather_idx = [0, 1, 2, 3, 4, 3]    (a padding cell repeats its own segment's
                         scatter_idx = [0, 1, 2, 3, 4]       first token, so nothing leaks across slots)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SegmentMeta:
    """Routing of ``num_tokens`` flattened tokens to slots, as the LoRA ops read it.

    Attributes:
        num_tokens: ``N``, rows of the flattened activations.
        num_slots: ``Z``, slots of the stacked adapter weights.
        slot_ids: host copy: the slot of each (non-empty) segment, in token order.
        lengths: host copy: tokens per segment.
        max_len: the padded grid's row length: the longest segment (0 when there is none), or for
            ``build_slot_segments`` the token count.
        uniform: every segment has ``max_len`` tokens, so ``x.view(S, max_len, d)`` needs no copy.
        identity: ``slot_ids == (0, 1, ..., Z - 1)``: the stacked weights are used as they are, no gather.
        seg_slots: ``(S,)`` int64: ``slot_ids`` on the device.
        token_slots: ``(N,)`` int64: the slot of each token.
        offsets: ``(S,)`` int32: cumulative segment ends (``torch._grouped_mm``'s ``offs``).
        gather_idx: ``(S * max_len,)`` int64 token of each cell of the padded ``(S, max_len)`` grid; a padding
            cell repeats its segment's first token. ``None`` when ``uniform``.
        scatter_idx: ``(N,)`` int64 grid cell of each token; padding cells are never read back, so they
            get zero gradient and add exactly nothing to dA / dB. ``None`` when ``uniform``.
        pad_spans: host copy: sorted, disjoint ``[start, end)`` token ranges that nothing downstream reads
            (a right-padded row's padding): their outputs are never used and their upstream gradient is zero.
            A backend may leave their LoRA term out (the Triton kernels write zero there and skip them in dA /
            dB, which they would add nothing to) or compute it (the torch path); the results that matter agree.
        cache: what a backend derives from the above once per step (the Triton kernels' schedule table).
    """

    num_tokens: int
    num_slots: int
    slot_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    max_len: int
    uniform: bool
    identity: bool
    seg_slots: torch.Tensor
    token_slots: torch.Tensor
    offsets: torch.Tensor
    gather_idx: torch.Tensor | None
    scatter_idx: torch.Tensor | None
    pad_spans: tuple[tuple[int, int], ...] = ()
    # Per-step launch tables that a backend derives from this metadata (built by the first layer, reused).
    cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_segments(self) -> int:
        return len(self.slot_ids)


def build_segments(
    slot_ids: Sequence[int],
    lengths: Sequence[int],
    *,
    num_slots: int,
    device: torch.device,
    pad_spans: Sequence[tuple[int, int]] = (),
) -> SegmentMeta:
    """Segment metadata for segments laid end to end from token 0 (zero-length segments are dropped).

    Runs on the host; its tensors go to ``device`` in one non-blocking copy per dtype, so building
    metadata never waits for the device.

    Args:
        slot_ids: slot of each segment, each in ``[0, num_slots)``; a slot may appear more than once.
        lengths: tokens of each segment (``>= 0``).
        num_slots: ``Z``.
        device: where the ops run.
        pad_spans: token ranges whose LoRA term nothing reads (see ``SegmentMeta.pad_spans``).

    Raises:
        ValueError: mismatched lengths, a slot out of range, a negative length, or pad spans that are not
            sorted, disjoint, non-empty ranges inside the tokens.
    """
    if len(slot_ids) != len(lengths):
        raise ValueError(f"{len(slot_ids)} slot ids for {len(lengths)} lengths")
    if any(not 0 <= z < num_slots for z in slot_ids):
        raise ValueError(f"slot ids {list(slot_ids)} outside [0, {num_slots})")
    if any(n < 0 for n in lengths):
        raise ValueError(f"negative segment length in {list(lengths)}")
    kept = [(int(z), int(n)) for z, n in zip(slot_ids, lengths, strict=True) if n > 0]
    return _segment_meta(tuple(z for z, _ in kept), tuple(n for _, n in kept), num_slots, device, pad_spans)


def build_slot_segments(
    lengths: Sequence[int], *, device: torch.device, pad_spans: Sequence[tuple[int, int]] = ()
) -> SegmentMeta:
    """One segment per slot, in slot order, empty ones kept: ``lengths[z]`` tokens of slot ``z``.

    The metadata's shapes then depend only on the slot count and the token count, never on which slots
    have tokens: what a step replayed from a CUDA graph needs. It is never
    ``uniform`` (a graph captured on the grid's free view would be wrong for a ragged step of the same size),
    and its grid rows (``max_len``) are as long as all the tokens, so the grid tables' shapes are fixed too
    (backends with ``torch._grouped_mm`` never build the grid).

    Raises:
        ValueError: a negative length, or bad pad spans (as ``build_segments``).
    """
    if any(n < 0 for n in lengths):
        raise ValueError(f"negative segment length in {list(lengths)}")
    slots = tuple(range(len(lengths)))
    return _segment_meta(slots, tuple(int(n) for n in lengths), len(lengths), device, pad_spans, ragged=True)


def _segment_meta(
    slots: tuple[int, ...],
    lens: tuple[int, ...],
    num_slots: int,
    device: torch.device,
    pad_spans: Sequence[tuple[int, int]],
    *,
    ragged: bool = False,
) -> SegmentMeta:
    """The metadata of segments ``lens`` (of slots ``slots``) laid end to end; ``ragged``: never uniform, and
    the grid's rows as long as all the tokens."""
    n_tokens = sum(lens)
    max_len = n_tokens if ragged else max(lens, default=0)
    spans = tuple((int(a), int(b)) for a, b in pad_spans)
    previous_end = 0
    for start, end in spans:
        if not previous_end <= start < end <= n_tokens:
            raise ValueError(f"pad spans {list(spans)} are not sorted disjoint ranges inside [0, {n_tokens})")
        previous_end = end
    uniform = not ragged and all(n == max_len for n in lens)

    lens_t = torch.tensor(lens, dtype=torch.int64)
    ends = torch.cumsum(lens_t, 0)
    starts = ends - lens_t
    seg_of_token = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
    token_slots = torch.tensor(slots, dtype=torch.int64)[seg_of_token]
    int64_parts = [torch.tensor(slots, dtype=torch.int64), token_slots]
    if not uniform:
        cells = torch.arange(max_len)
        is_real = cells[None, :] < lens_t[:, None]  # (S, max_len)
        # An empty segment's cells (never read back) read a token that exists: its start, or the last token.
        first = starts.clamp(max=max(n_tokens - 1, 0))
        gather = torch.where(is_real, starts[:, None] + cells[None, :], first[:, None]).reshape(-1)
        scatter = seg_of_token * max_len + (torch.arange(n_tokens) - starts[seg_of_token])
        int64_parts += [gather, scatter]
    moved = _to_device(int64_parts, device)
    return SegmentMeta(
        num_tokens=n_tokens,
        num_slots=num_slots,
        slot_ids=slots,
        lengths=lens,
        max_len=max_len,
        uniform=uniform,
        identity=slots == tuple(range(num_slots)),
        seg_slots=moved[0],
        token_slots=moved[1],
        offsets=upload(ends.to(torch.int32), device),
        gather_idx=moved[2] if not uniform else None,
        scatter_idx=moved[3] if not uniform else None,
        pad_spans=spans,
    )


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without making the host wait: a CUDA copy goes through pinned memory, so it is
    truly asynchronous (a copy from pageable memory may wait for the work already queued on the device)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _to_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move same-dtype 1-d host tensors to ``device`` in one copy (one launch instead of one per tensor)."""
    if device.type == "cpu":
        return parts
    flat = upload(torch.cat(parts), device)
    return list(torch.split(flat, [p.numel() for p in parts]))
