"""Validation of a pack's slots: each slot's token-weighted mean loss on its validation rows (a DPO trial's: its mean
pair loss, with its reward metrics), many slots in shared packed forwards, and the best adapter so far kept per slot
(``SlotState.best``)."""

from __future__ import annotations

import torch

from worker.engine import dpo
from worker.engine.batch import SlotRows, cut_forwards
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
    preference = [slot for slot in slots if states[slot].spec.dpo is not None and states[slot].val]
    losses: dict[int, float | None] = _evaluate_preferences(engine, preference) if preference else {}
    slots = [slot for slot in slots if slot not in losses]
    if slots:
        losses.update(_token_mean_losses(engine, slots))
    for slot, state in states.items():
        loss = losses[slot]
        if loss is not None and loss == loss and (state.best_val_loss is None or loss < state.best_val_loss):
            state.best_val_loss, state.best_step = loss, state.steps_done
            state.best = engine.store.read(engine.store.weights, slot)
            state.best_metrics = state.val_metrics
    return losses


def _token_mean_losses(engine: PackEngine, slots: list[int]) -> dict[int, float | None]:
    """The slots' token-weighted mean loss on their validation rows (None: no rows)."""
    totals = torch.zeros(len(engine.slots), dtype=torch.float64, device=engine.device)
    n_targets = dict.fromkeys(slots, 0)
    for parts in _validation_forwards(engine, slots):
        batch = engine.passes.pack(parts)
        totals += engine.passes.loss_sums(batch, training=False).double()
        for slot, n in batch.n_targets.items():
            n_targets[slot] += n
    values = totals.tolist()  # device sync
    return {slot: values[slot] / n_targets[slot] if engine.state(slot).val else None for slot in slots}


def _evaluate_preferences(engine: PackEngine, slots: list[int]) -> dict[int, float | None]:
    """The DPO slots' mean pair loss on their validation pairs, their reward metrics kept as ``val_metrics``: each
    slot's sequences scored under its adapter in shared forwards, against the reference log-probabilities (cached
    per pair; the pairs not cached yet from a pass of the bare base)."""
    states = {slot: engine.state(slot) for slot in slots}
    references = engine.training.references
    needs = [dpo.PairRows(state.val_key, state.val, range(len(state.val) // 2)) for state in states.values()]
    dpo.fill_references(engine.passes, references, needs, EVAL_MAX_TOKENS)
    sums: dict[int, list[torch.Tensor]] = {slot: [] for slot in slots}
    for parts in _validation_forwards(engine, slots):
        batch = engine.passes.pack(parts)
        row_sums, offset = engine.passes.row_loss_sums(batch, training=False), 0
        for part in parts:
            sums[part.slot].append(row_sums[offset : offset + len(part.examples)])
            offset += len(part.examples)
    metrics = []
    for slot, state in states.items():
        objective = state.spec.dpo
        assert objective is not None
        cached = references.get(state.val_key, range(len(state.val) // 2))
        metrics.append(dpo.preference_metrics(dpo.pair_terms(torch.cat(sums[slot]), cached, state.val, objective)))
    values = torch.stack(metrics).tolist()  # device sync
    losses: dict[int, float | None] = {}
    for (slot, state), row in zip(states.items(), values, strict=True):
        measured = dpo.PreferenceMetrics(*row)
        state.val_metrics = measured.as_points()
        losses[slot] = measured.loss
    return losses


def evaluation_passes(engine: PackEngine, slots: list[int]) -> int:
    """The forwards ``evaluate_slots(engine, slots)`` runs."""
    return len(_validation_forwards(engine, slots))


def _validation_forwards(engine: PackEngine, slots: list[int]) -> list[list[SlotRows]]:
    """The slots' validation rows grouped into the packed forwards ``evaluate_slots`` runs."""
    return cut_forwards([(slot, engine.state(slot).val) for slot in slots], EVAL_MAX_TOKENS)
