"""Segment metadata: the host-built routing every layer reads."""

from __future__ import annotations

import pytest
import torch

from kernels import build_segments

CPU = torch.device("cpu")


def test_ragged_segments_match_the_docstring_example() -> None:
    meta = build_segments([2, 0], [3, 2], num_slots=3, device=CPU)
    assert (meta.num_tokens, meta.max_len, meta.uniform, meta.identity) == (5, 3, False, False)
    assert meta.token_slots.tolist() == [2, 2, 2, 0, 0]
    assert meta.offsets.tolist() == [3, 5] and meta.offsets.dtype == torch.int32
    assert meta.gather_idx is not None and meta.scatter_idx is not None
    assert meta.gather_idx.tolist() == [0, 1, 2, 3, 4, 3]
    assert meta.scatter_idx.tolist() == [0, 1, 2, 3, 4]


def test_uniform_identity_and_dropped_empty_segments() -> None:
    meta = build_segments([0, 1, 2], [4, 4, 4], num_slots=3, device=CPU)
    assert meta.uniform and meta.identity and meta.gather_idx is None
    meta = build_segments([1, 0, 2], [4, 0, 4], num_slots=3, device=CPU)  # slot 0 has no tokens
    assert meta.slot_ids == (1, 2) and meta.uniform and not meta.identity
    empty = build_segments([], [], num_slots=2, device=CPU)
    assert empty.num_tokens == 0 and empty.num_segments == 0


def test_bad_segments_raise() -> None:
    with pytest.raises(ValueError, match="outside"):
        build_segments([3], [1], num_slots=3, device=CPU)
    with pytest.raises(ValueError, match="negative"):
        build_segments([0], [-1], num_slots=1, device=CPU)
    with pytest.raises(ValueError, match="2 slot ids for 1 lengths"):
        build_segments([0, 1], [1], num_slots=2, device=CPU)


def test_pad_spans_must_be_sorted_disjoint_ranges_inside_the_tokens() -> None:
    meta = build_segments([0, 1], [4, 6], num_slots=2, device=torch.device("cpu"), pad_spans=[(2, 4), (8, 10)])
    assert meta.pad_spans == ((2, 4), (8, 10))
    for bad in ([(3, 3)], [(8, 11)], [(5, 7), (6, 9)], [(6, 8), (2, 4)]):
        with pytest.raises(ValueError, match="pad spans"):
            build_segments([0, 1], [4, 6], num_slots=2, device=torch.device("cpu"), pad_spans=bad)
