"""``TrainingStep``: one optimizer step of every training slot of a pack (``PackEngine.step``).

A step takes every training slot's next micro-batch (``feed.draw``), runs them as one packed stream through the
model (``ModelPasses.forward_backward``, or its CUDA graph: capture.py), calls one vectorised AdamW update
(optim.py) and syncs with the device once. A step with DPO trials among its slots first runs the bare base over the
pairs whose reference log-probabilities are not cached yet, then scores every sequence of the stream on its own
(``ModelPasses.forward_backward_rows``, eagerly: no graph holds the reference pass's varying work). While the device
computes, the host packs the next step's batch (``feed.peek``). A joint forward/backward that raises is retried slot
by slot, so that only the slots that break fail (slots are independent: the gradients are the same).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from worker.engine import dpo, feed
from worker.engine.batch import PackedBatch, SlotRows
from worker.engine.capture import StepGraphs
from worker.engine.feed import BatchKey
from worker.engine.optim import SlotAdamW
from worker.engine.passes import EVAL_MAX_TOKENS, ModelPasses
from worker.engine.slots import SlotState, StepStats
from worker.engine.store import AdapterStore

logger = logging.getLogger(__name__)

# Marks a slot failed, with the exception that failed it (the engine's ``failures``).
FailSlot = Callable[[int, BaseException], None]


class TrainingStep:
    """The step's machinery: the passes, the store's gradients, the optimizer, the captured graphs (None: every
    step runs eagerly) and the batch packed ahead for the next step. With ``retry_alone`` off (a rank of a pack
    over several GPUs) a failed joint step fails all its slots: a retry would run passes the other ranks do not."""

    def __init__(self, passes: ModelPasses, store: AdapterStore, optimizer: SlotAdamW, graphs: StepGraphs | None,
                 *, retry_alone: bool) -> None:  # fmt: skip
        self.passes, self.store, self.optimizer, self.graphs = passes, store, optimizer, graphs
        self.retry_alone = retry_alone
        self.prefetched: tuple[BatchKey, PackedBatch] | None = None
        self.references = dpo.ReferenceCache()  # the DPO trials' reference log-probabilities (dpo.py)

    def run(self, slots: list[SlotState | None], fail: FailSlot, pack_step: int) -> tuple[dict[str, float], StepStats]:
        """Step every training slot of ``slots``; ``{trial_id: mean target-token loss}`` of those that stepped,
        and the stats of the step (the pack's ``pack_step``-th). A slot whose data or step raises goes to ``fail``
        and the others step as usual; a NaN loss is a loss, not a failure."""
        started = time.perf_counter()
        parts, key = feed.draw(slots, fail)
        prefetched, self.prefetched = self.prefetched, None
        batch = prefetched[1] if prefetched is not None and prefetched[0] == key else None
        self.store.grads.zero_()
        losses, data_s, width, captured = self._losses_and_grads(parts, batch, fail, slots)
        stepped = [p.slot for p in parts if not _state(slots, p.slot).failed]
        self.optimizer.step(  # also refreshes store.compute; only as far into each row as its rank reaches
            {slot: _state(slots, slot).lr() for slot in stepped},
            {slot: self.store.live_columns(slot) for slot in stepped},
        )
        prefetch_started = time.perf_counter()
        self.prefetched = self._prefetch(slots, stepped)  # host work while the device computes this step
        sync_started = time.perf_counter()
        values = losses.tolist()  # the step's one device sync: it waits for the update queued above
        sync_s = time.perf_counter() - sync_started
        part_tokens = [sum(len(e.input_ids) for e in part.examples) for part in parts]
        for part, tokens in zip(parts, part_tokens, strict=True):
            state = _state(slots, part.slot)
            if not state.failed:
                state.steps_done += 1
                state.pack_steps += 1
                state.pack_tokens += tokens
                state.last_train_loss = values[part.slot]
        stats = StepStats.measure(
            pack_step, parts, len(stepped), started, self.passes.device, width, tokens=sum(part_tokens),
            data_s=data_s, prefetch_s=sync_started - prefetch_started, sync_wait_s=sync_s, captured=captured,
        )  # fmt: skip
        return {_state(slots, slot).spec.trial_id: values[slot] for slot in stepped}, stats

    def _prefetch(self, slots: list[SlotState | None], stepped: list[int]) -> tuple[BatchKey, PackedBatch] | None:
        """Pack the next step's batch now, while the device is busy; ``run()`` uses it only if it then
        draws exactly these micro-batches (``feed.peek``)."""
        parts, key = feed.peek(slots, stepped)
        if not parts:
            return None
        try:
            return key, self.passes.pack(parts, static_shapes=self.graphs is not None)
        except Exception:  # the step that needs it packs again and fails (or not) on its own
            return None

    def _losses_and_grads(
        self, parts: list[SlotRows], batch: PackedBatch | None, fail: FailSlot, slots: list[SlotState | None]
    ) -> tuple[torch.Tensor, float, int, bool]:
        """``(Z,)`` per-slot mean losses, gradients accumulated into ``store.grads``, the seconds spent
        packing the joint batch on the step's critical path (0 when ``batch`` came prefetched), the stream's
        tokens (padding included) and whether a CUDA graph ran the step.

        If the joint forward/backward raises, each slot is retried alone (slots are independent, so the
        gradients are the same), to fail only the slot(s) that break.
        """
        passes = self.passes
        losses = torch.zeros(passes.num_slots, device=passes.device)
        data_s = 0.0
        if not parts:
            return losses, data_s, 0, False
        try:
            if batch is None:  # the prefetch missed
                data_started = time.perf_counter()
                batch = passes.pack(parts, static_shapes=self.graphs is not None)
                data_s = time.perf_counter() - data_started
            width = int(batch.input_ids.shape[1])
            if any(_state(slots, part.slot).spec.dpo is not None for part in parts):
                return self._preference_pass(batch, parts, slots), data_s, width, False
            captured = self.graphs.run(batch) if self.graphs is not None else None
            if captured is not None:
                return captured, data_s, width, True
            return passes.forward_backward(batch), data_s, width, False
        except Exception as exc:
            if len(parts) == 1 or not self.retry_alone:  # a retry would run passes the other ranks do not
                for part in parts:
                    fail(part.slot, exc)
                return losses, data_s, 0, False
            logger.warning("joint step failed (%s); retrying its %d slots one by one", exc, len(parts))
        self.store.grads.zero_()
        width = 0
        for part in parts:
            try:
                batch = passes.pack([part])
                width += int(batch.input_ids.shape[1])
                dpo_slot = _state(slots, part.slot).spec.dpo is not None
                losses += self._preference_pass(batch, [part], slots) if dpo_slot else passes.forward_backward(batch)
            except Exception as exc:
                self.store.grads[part.slot].zero_()
                fail(part.slot, exc)
        return losses, data_s, width, False

    def _preference_pass(self, batch: PackedBatch, parts: list[SlotRows],
                         slots: list[SlotState | None]) -> torch.Tensor:
        """The forward and backward of a batch with DPO slots: the pairs' reference log-probabilities (cached, or
        from a pass of the bare base now: ``dpo.fill_references``), then each slot's loss from its sequences'
        summed losses (``dpo.slot_losses``)."""
        states = {part.slot: _state(slots, part.slot) for part in parts}
        needs = [dpo.PairRows(states[p.slot].train_key, states[p.slot].train, p.items)
                 for p in parts if states[p.slot].spec.dpo is not None]
        dpo.fill_references(self.passes, self.references, needs, EVAL_MAX_TOKENS)
        references = {p.slot: self.references.get(states[p.slot].train_key, p.items)
                      for p in parts if states[p.slot].spec.dpo is not None}
        objectives = {slot: state.spec.dpo for slot, state in states.items()}
        return self.passes.forward_backward_rows(
            batch, lambda sums: dpo.slot_losses(sums, parts, objectives, references, batch.target_counts))

    def close(self) -> None:
        """Release the captured graphs and the batch packed ahead."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.prefetched = None


def _state(slots: list[SlotState | None], slot: int) -> SlotState:
    state = slots[slot]
    assert state is not None, f"slot {slot} is free"
    return state
