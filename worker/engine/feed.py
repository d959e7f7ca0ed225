"""What each pack step trains on: every training slot's next micro-batch from its own sampler, and the
next step's, peeked (not consumed) so the engine can pack it on the host while the device works."""

from __future__ import annotations

from collections.abc import Callable

from worker.engine.batch import SlotRows, dropout_key
from worker.engine.slots import SlotState

BatchKey = tuple[tuple[int, str, int, tuple[int, ...]], ...]  # (slot, trial id, trial step, row indices) each


def draw(
    slots: list[SlotState | None], on_error: Callable[[int, Exception], None]
) -> tuple[list[SlotRows], BatchKey]:
    """Every training slot's next micro-batch, consumed from its sampler, and the key that identifies them.

    A slot whose draw raises is reported to ``on_error`` and left out.
    """
    parts, key = [], []
    for slot, state in enumerate(slots):
        if state is not None and state.training:
            try:
                indices = state.sampler.next_indices()
                parts.append(_rows(slot, state, indices, state.steps_done))
                key.append((slot, state.spec.trial_id, state.steps_done, tuple(indices)))
            except Exception as exc:
                on_error(slot, exc)
    return parts, tuple(key)


def peek(slots: list[SlotState | None], stepped: list[int]) -> tuple[list[SlotRows], BatchKey]:
    """The micro-batches ``draw()`` will return after the step in flight (``stepped``), if nothing changes.

    Peeking changes no sampler's stream, so a prediction that turns out wrong (an evict, an admit, a
    failure in between) costs only the host work.
    """
    parts, key = [], []
    for slot in stepped:
        state = slots[slot]
        if state is not None and state.steps_done + 1 < state.spec.max_steps:
            indices = state.sampler.peek()
            parts.append(_rows(slot, state, indices, state.steps_done + 1))
            key.append((slot, state.spec.trial_id, state.steps_done + 1, tuple(indices)))
    return parts, tuple(key)


def _rows(slot: int, state: SlotState, indices: list[int], step: int) -> SlotRows:
    """The slot's examples of the items at ``indices``, with its dropout keyed by its own ``step``."""
    return SlotRows(
        slot,
        state.examples_at(indices),
        dropout=state.spec.lora_dropout,
        dropout_key=dropout_key(state.dropout_seed, step),
        items=tuple(indices),
    )
