"""Validation of a pack's slots: each slot's token-weighted mean loss on its validation rows, many slots in shared
packed forwards, and the best adapter so far kept per slot (``SlotState.best``)."""

from __future__ import annotations

import torch

from worker.engine.batch import SlotRows
from worker.engine.data import Example
from worker.engine.pack_engine import PackEngine
from worker.engine.passes import EVAL_MAX_TOKENS


def evaluate(engine: PackEngine, slot: int) -> float | None:
    """Token-weighted mean loss on the slot's validation rows (no dropout); ``None`` without any.

    A loss below the best so far (NaN never is) makes the current adapter the slot's best.
    """
    return evaluate_slots(engine, [slot])[slot]


@torch.no_grad()
def evaluate_slots(engine: PackEngine, slots: list[int]) -> dict[int, float | None]:
    """``evaluate`` of several slots at once: their validation rows go through the model together, in
    packed forwards of up to ``EVAL_MAX_TOKENS`` tokens (no per-trial loop; one device sync at the end)."""
    states = {slot: engine.state(slot) for slot in slots}
    totals = torch.zeros(len(engine.slots), dtype=torch.float64, device=engine.device)
    n_targets = dict.fromkeys(slots, 0)
    for parts in _validation_forwards(engine, slots):
        batch = engine.passes.pack(parts)
        totals += engine.passes.loss_sums(batch, training=False).double()
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
            state.best = engine.store.read(engine.store.weights, slot)
    return losses


def evaluation_passes(engine: PackEngine, slots: list[int]) -> int:
    """The forwards ``evaluate_slots(engine, slots)`` runs."""
    return len(_validation_forwards(engine, slots))


def _validation_forwards(engine: PackEngine, slots: list[int]) -> list[list[SlotRows]]:
    """The slots' validation rows grouped into the packed forwards ``evaluate_slots`` runs."""
    return _eval_forwards([(slot, engine.state(slot).val) for slot in slots], EVAL_MAX_TOKENS)


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
