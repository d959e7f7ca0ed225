"""Host-side packing of a step and the chunked per-slot loss (equal to the full-logits loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.engine.factories import token_loss_sum
from worker.engine.batch import SlotRows, pack_rows, shape_bucket
from worker.engine.capture import _tensors
from worker.engine.data import IGNORE_INDEX, Example, collate
from worker.engine.lora import LoraContext
from worker.engine.loss import slot_loss_sums, target_token_loss

CPU = torch.device("cpu")
VOCAB, HIDDEN = 11, 8


def _example(n: int, prompt: int, seed: int) -> Example:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


def _parts() -> list[SlotRows]:
    # Slot 2 with two rows, slot 0 with one; slot 1 sits this step out.
    return [
        SlotRows(2, [_example(5, 2, 0), _example(7, 3, 1)], dropout=0.5, dropout_key=123),
        SlotRows(0, [_example(4, 1, 2)]),
    ]


def test_rows_go_slot_by_slot_end_to_end_with_their_segments() -> None:
    batch = pack_rows(_parts(), pad_token_id=0, num_slots=3, device=CPU, loss_chunk=4)
    assert batch.input_ids.shape == (1, 16) and batch.n_rows == 3  # 5 + 7 + 4 tokens, no padding
    flat = [t for part in _parts() for e in part.examples for t in e.input_ids]
    assert batch.input_ids[0].tolist() == flat
    assert batch.position_ids[0].tolist() == [*range(5), *range(7), *range(4)]  # restart with every row
    assert batch.cu_seqlens.tolist() == [0, 5, 12, 16] and batch.max_row_len == 7
    meta = batch.routing.meta
    assert (meta.slot_ids, meta.lengths, meta.pad_spans) == ((2, 0), (12, 4), ())
    assert batch.n_targets == {2: 3 + 4, 0: 3} and batch.target_counts.tolist() == [3.0, 1.0, 7.0]
    assert batch.targets.slots.tolist() == [2] * 7 + [0] * 3
    assert batch.targets.rows.tolist() == [0] * 3 + [1] * 4 + [2] * 3
    # A row's last token predicts nothing (the next token is another row's first).
    assert batch.targets.positions.tolist() == [1, 2, 3, 7, 8, 9, 10, 12, 13, 14]
    assert batch.targets.labels.tolist() == [flat[p + 1] for p in batch.targets.positions.tolist()]
    # Chunks of 4 targets cut slot 2's run; each chunk is routed by its own segments.
    assert [(c.start, c.end, c.routing.meta.slot_ids) for c in batch.targets.chunks] == [
        (0, 4, (2,)),
        (4, 8, (2, 0)),
        (8, 10, (0,)),
    ]
    # Dropout keys of slot 2's rows do not depend on what else is in the pack.
    alone = pack_rows(_parts()[:1], pad_token_id=0, num_slots=3, device=CPU, loss_chunk=4)
    assert batch.routing.dropout is not None and alone.routing.dropout is not None
    assert torch.equal(batch.routing.dropout.token_keys[:12], alone.routing.dropout.token_keys)
    assert batch.routing.dropout.threshold[12:].eq(0).all()  # slot 0: p = 0 keeps everything


def test_the_stream_is_padded_to_the_width_multiple_with_one_row_nothing_reads() -> None:
    batch = pack_rows(_parts(), pad_token_id=9, num_slots=3, device=CPU, loss_chunk=4, pad_to_multiple=8)
    assert batch.input_ids.shape == (1, 16)  # 16 is already a multiple of 8
    batch = pack_rows(_parts(), pad_token_id=9, num_slots=3, device=CPU, loss_chunk=4, pad_to_multiple=64)
    assert batch.input_ids.shape == (1, 64) and batch.input_ids[0, 16:].eq(9).all()
    assert batch.cu_seqlens.tolist() == [0, 5, 12, 16, 64] and batch.max_row_len == 48
    assert batch.position_ids[0, 16:].tolist() == list(range(48)) and batch.n_rows == 3
    meta = batch.routing.meta
    assert (meta.slot_ids, meta.lengths, meta.pad_spans) == ((2, 0), (12, 52), ((16, 64),))
    assert batch.targets.positions.max() < 16 and batch.n_targets == {2: 7, 0: 3}


def test_shape_buckets_are_few_and_waste_at_most_a_sixteenth() -> None:
    sizes = {shape_bucket(n, 64) for n in range(4000, 8001)}
    assert len(sizes) <= 17 and all(size % 64 == 0 for size in sizes)
    for n in [1, 63, 64, 65, 100, 1000, 4097, 7010, 70_000]:
        assert n <= shape_bucket(n, 64) <= -(-(n + n / 16) // 64) * 64
        assert n <= shape_bucket(n, 1) <= n + n / 16
    assert shape_bucket(0, 64) == 64 and shape_bucket(7010, 1) == 7168


def test_static_shapes_depend_on_the_buckets_only_not_on_which_slots_train() -> None:
    """Two steps whose tokens and targets fall in the same buckets: the same tensors' shapes and host values,
    so one captured graph replays both (capture.py)."""
    moved = [SlotRows(1, [e for part in _parts() for e in part.examples], dropout=0.1)]  # the same rows, slot 1
    batches = [
        pack_rows(parts, pad_token_id=9, num_slots=3, device=CPU, loss_chunk=128, pad_to_multiple=64,
                  static_shapes=True)
        for parts in (_parts(), moved)
    ]
    first, second = batches
    # 16 tokens in a stream of 64: 48 of padding, in rows of at most 128 (one here).
    assert first.shape_key() == second.shape_key() == (64, 5, 128, 256, 2, 1)
    assert [t.shape for t in _tensors(first)] == [t.shape for t in _tensors(second)]
    # Slot order (slot 0's row first), the padding row with the last slot.
    assert first.routing.meta.slot_ids == (0, 1, 2) and first.routing.meta.lengths == (4, 0, 60)
    assert first.position_ids[0, :16].tolist() == [*range(4), *range(5), *range(7)]
    assert second.routing.meta.lengths == (0, 16, 48)
    assert all(chunk.routing.meta.slot_ids == (0, 1, 2) for chunk in first.targets.chunks)
    assert first.n_targets == {2: 7, 0: 3} and first.target_counts.tolist() == [3.0, 1.0, 7.0]
    # 37 targets are padded to their bucket with ignored labels of the last slot, in chunks of 64.
    padded = pack_rows([SlotRows(0, [_example(40, 3, 5)])], pad_token_id=9, num_slots=3, device=CPU,
                       loss_chunk=64, pad_to_multiple=64, static_shapes=True)  # fmt: skip
    assert padded.n_targets == {0: 37} and padded.targets.labels.shape[0] == shape_bucket(37, 256) == 256
    assert padded.targets.labels[37:].eq(IGNORE_INDEX).all() and padded.targets.slots[37:].eq(2).all()
    assert len(padded.targets.chunks) == 4 and padded.targets.chunks[-1].routing.meta.lengths == (0, 0, 64)
    # A larger stream: its padding (up to the bucket's step, 256 here) goes in two rows of at most 128.
    rows = [SlotRows(0, [_example(90, 3, seed) for seed in range(50)])]  # 4500 tokens, bucket 4608
    large = pack_rows(rows, pad_token_id=9, num_slots=3, device=CPU, loss_chunk=4096, pad_to_multiple=64,
                      static_shapes=True)  # fmt: skip
    bounds = large.cu_seqlens.tolist()
    assert large.input_ids.shape[1] == 4608 and len(bounds) == 50 + 2 + 1
    assert [b - a for a, b in zip(bounds[-3:-1], bounds[-2:], strict=True)] == [54, 54] and large.max_row_len == 128


def test_chunked_slot_losses_equal_the_full_logits_loss_and_its_gradients() -> None:
    torch.manual_seed(0)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    batch = pack_rows(_parts(), pad_token_id=0, num_slots=3, device=CPU, loss_chunk=3)
    hidden = torch.randn(1, 16, HIDDEN, requires_grad=True)
    weights = torch.tensor([0.5, 2.0, 1.5])
    sums = slot_loss_sums(hidden, lm_head, batch.targets, LoraContext(), num_slots=3, checkpointed=True)
    (sums * weights).sum().backward()
    chunked_grad, hidden.grad = hidden.grad, None
    assert chunked_grad is not None and lm_head.weight.grad is not None
    chunked_head_grad, lm_head.weight.grad = lm_head.weight.grad.clone(), None

    # The same hidden states as a right-padded (rows, seq) batch, and its full logits (never materialised).
    bounds = batch.cu_seqlens.tolist()
    padded = torch.stack(
        [F.pad(hidden[0, a:b], (0, 0, 0, 7 - (b - a))) for a, b in zip(bounds, bounds[1:], strict=False)]
    )
    logits = lm_head(padded)
    labels = collate([e for part in _parts() for e in part.examples], 0).labels
    by_slot = [token_loss_sum(logits[2:], labels[2:]), torch.zeros(()), token_loss_sum(logits[:2], labels[:2])]
    full = torch.stack(by_slot)
    torch.testing.assert_close(sums.detach(), full.detach(), rtol=1e-6, atol=1e-6)
    (full * weights).sum().backward()
    torch.testing.assert_close(chunked_grad, hidden.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chunked_head_grad, lm_head.weight.grad, rtol=1e-6, atol=1e-7)

    # The single-trial form used outside the engine: the mean over all targets.
    mean = target_token_loss(padded, labels, lm_head, chunk=2)
    torch.testing.assert_close(mean, token_loss_sum(logits, labels) / 10, rtol=1e-6, atol=1e-7)
