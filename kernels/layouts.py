"""How per-segment matmuls run over the flattened tokens: a padded grid of segments for ``torch.bmm``, or
``torch._grouped_mm`` over the ragged segments as they lie. ``lora_delta`` is written against ``Layout``.
"""

from __future__ import annotations

import os

import torch

from kernels.segments import SegmentMeta


def use_grouped_mm() -> bool:
    """Whether ragged segments go through ``torch._grouped_mm`` where it runs (bf16, sm90+); else the padded
    grid. ``LORAPLANE_GROUPED_MM=0`` switches it off (read per call, so a benchmark can compare both)."""
    return os.environ.get("LORAPLANE_GROUPED_MM", "1") != "0"


class Layout:
    """Per-segment operations. "Segment layout" is the layout's own arrangement of the tokens' rows."""

    def __init__(self, meta: SegmentMeta) -> None:
        self.meta = meta

    def per_segment(self, stacked: torch.Tensor) -> torch.Tensor:
        """``(Z, ...)`` slot-stacked weights -> ``(S, ...)`` per segment (no copy when slots are in order)."""
        return stacked if self.meta.identity else stacked.index_select(0, self.meta.seg_slots)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``(tokens, d)`` -> segment layout."""
        raise NotImplementedError

    def grad_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``(tokens, d)`` upstream gradient -> segment layout, with zeros wherever no token is."""
        raise NotImplementedError

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Segment layout -> ``(tokens, d)``."""
        raise NotImplementedError

    def mm(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``t_s @ w_s`` for every segment; ``w`` is ``(S, k, n)``."""
        raise NotImplementedError

    def mm_t(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``t_s @ w_sᵀ`` for every segment; ``w`` is ``(S, n, k)``."""
        raise NotImplementedError

    def scale(self, scale: torch.Tensor) -> torch.Tensor:
        """``(Z,)`` per-slot scale -> a float32 multiplier that broadcasts over the segment layout."""
        raise NotImplementedError

    def expand(self, s: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
        """``(tokens, d_out)``: ``base + S' B`` per segment (``base`` updated in place), or ``S' B``."""
        raise NotImplementedError

    def accumulate_outer(self, buf: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> None:
        """``buf[z] += t1_sᵀ t2_s`` for every segment ``s`` of slot ``z``; ``buf`` is ``(Z, k, n)``, any strides."""
        raise NotImplementedError


class GridLayout(Layout):
    """Segments as a ``(S, max_len, d)`` grid: a free view when they are equal, else a gather into padded rows.

    Padding cells read their segment's first token and are never read back, so their upstream gradient
    is zero and they add exactly nothing to dA, dB or dX.
    """

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        m = self.meta
        if m.uniform:
            return t.view(m.num_segments, m.max_len, t.shape[-1])
        assert m.gather_idx is not None
        return t.index_select(0, m.gather_idx).view(m.num_segments, m.max_len, t.shape[-1])

    def grad_rows(self, t: torch.Tensor) -> torch.Tensor:
        m = self.meta
        if m.uniform:
            return t.view(m.num_segments, m.max_len, t.shape[-1])
        assert m.scatter_idx is not None
        grid = t.new_zeros(m.num_segments * m.max_len, t.shape[-1]).index_copy_(0, m.scatter_idx, t)
        return grid.view(m.num_segments, m.max_len, t.shape[-1])

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        m = self.meta
        if m.uniform:
            return t.reshape(m.num_tokens, t.shape[-1])
        assert m.scatter_idx is not None
        return t.reshape(-1, t.shape[-1]).index_select(0, m.scatter_idx)

    def mm(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.bmm(t, w)

    def mm_t(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.bmm(t, w.transpose(1, 2))

    def scale(self, scale: torch.Tensor) -> torch.Tensor:
        return self.per_segment(scale).view(-1, 1, 1)

    def expand(self, s: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
        m = self.meta
        if base is None:
            return self.tokens(torch.bmm(s, b))
        if m.uniform:  # the add happens in the GEMM epilogue (beta = 1), in place
            base.view(m.num_segments, m.max_len, base.shape[-1]).baddbmm_(s, b)
            return base
        return base.add_(self.tokens(torch.bmm(s, b)))

    def accumulate_outer(self, buf: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> None:
        if self.meta.identity:  # straight into the store, in the GEMM epilogue
            buf.baddbmm_(t1.transpose(1, 2), t2)
        else:
            buf.index_add_(0, self.meta.seg_slots, torch.bmm(t1.transpose(1, 2), t2))


class GroupedLayout(Layout):
    """Ragged segments as they lie, through ``torch._grouped_mm`` with the segments' end offsets."""

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def grad_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mm(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(t, w, offs=self.meta.offsets)

    def mm_t(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(t, w.transpose(1, 2), offs=self.meta.offsets)

    def scale(self, scale: torch.Tensor) -> torch.Tensor:
        return scale.index_select(0, self.meta.token_slots)[:, None]

    def expand(self, s: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
        y = torch._grouped_mm(s, b, offs=self.meta.offsets)
        return y if base is None else base.add_(y)

    def accumulate_outer(self, buf: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> None:
        outer = torch._grouped_mm(t1.t(), t2, offs=self.meta.offsets)  # (S, k, n): groups split the tokens
        if self.meta.identity:
            buf.add_(outer)
        else:
            buf.index_add_(0, self.meta.seg_slots, outer)


def layout_for(x: torch.Tensor, meta: SegmentMeta, dims: tuple[int, ...]) -> Layout:
    """Equal segments: the grid (a free view); ragged: grouped_mm where supported, else the padded grid."""
    if not meta.uniform and use_grouped_mm() and grouped_mm_supported(x, dims):
        return GroupedLayout(meta)
    return GridLayout(meta)


def grouped_mm_supported(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """``torch._grouped_mm`` runs bf16 on sm90+ and wants 16-byte aligned rows (multiples of 8 bf16)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(d % 8 == 0 for d in dims)
