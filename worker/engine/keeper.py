"""The last pack's engine, kept for the next pack of the same base model and shape.

A new ``PackEngine`` wraps the model's layers, allocates the adapter store and the optimizer state, and captures
its CUDA graphs again on its first steps (two eager warm-up runs and a capture per batch shape: seconds on a GPU,
most of a small task's first minute — issue 30). A worker keeps its base models warm across packs
(worker/model_cache.py), and with the model this keeps the engine around it: the next pack of that model over the
same layers and rank takes it as it is, slots freed and its graphs still captured, and its first step replays.

One engine is kept, the newest: it holds its store, optimizer state and graphs' memory pool on the device, and its
model's layers stay wrapped until it is dropped (``drop``: the model is bare again). A pack of another model, or
of the same model over layers the kept engine does not wrap or at a higher rank, drops it and builds its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from worker.engine.pack_engine import PackEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineShape:
    """What fixes an engine for its life, besides its capacity: the layers it wraps and the rank of its slots."""

    layers: frozenset[str]  # empty: every linear layer
    max_rank: int
    activation_checkpointing: bool

    def fits(self, wanted: EngineShape) -> bool:
        """Whether an engine of this shape can run a pack that wants ``wanted``: it wraps every layer the pack's
        trials may target (a layer no slot targets computes nothing) at a rank at least theirs (slots are padded
        to it). An early-exit task's later packs hold fewer trials, often of a lower rank, than its first."""
        covers = not self.layers or (bool(wanted.layers) and wanted.layers <= self.layers)
        return (covers and wanted.max_rank <= self.max_rank
                and wanted.activation_checkpointing == self.activation_checkpointing)


@dataclass
class _Kept:
    model: PreTrainedModel
    shape: EngineShape
    engine: PackEngine


class EngineKeeper:
    """Hands out the kept engine where it fits a pack (``take``), takes it back after the pack (``keep``). Safe to
    call from several threads (a worker running packs of several models at once: a pack that finds the engine
    handed out builds its own)."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self._lock = threading.Lock()
        self.reuses = 0  # packs that took the kept engine (the tests and the pack profile read it)

    def take(self, model: PreTrainedModel, shape: EngineShape, needed: int,
             build: Callable[[], PackEngine]) -> tuple[PackEngine, EngineShape]:  # fmt: skip
        """The kept engine if it is over ``model``, its shape fits ``shape`` and it has at least ``needed`` slots
        (it is handed out, no longer kept); else the kept one is dropped and ``build()`` makes a new one of
        ``shape``. Also the engine's own shape (to ``keep`` it by)."""
        with self._lock:
            kept, self._kept = self._kept, None
            fits = (kept is not None and kept.model is model and kept.shape.fits(shape)
                    and len(kept.engine.slots) >= needed)
            self.reuses += fits
        if kept is not None and fits:
            kept.engine.reset()
            logger.info("pack reuses the kept engine (%d slots, %d captured graphs)", len(kept.engine.slots),
                        kept.engine.graphs.count if kept.engine.graphs is not None else 0)
            return kept.engine, kept.shape
        if kept is not None:
            kept.engine.close()
        return build(), shape

    def keep(self, model: PreTrainedModel, shape: EngineShape, engine: PackEngine) -> None:
        """Keep ``engine`` (every slot free: its pack ended well) for the next pack; an older one is dropped."""
        with self._lock:
            older, self._kept = self._kept, _Kept(model, shape, engine)
        if older is not None:
            older.engine.close()

    def holds(self, model: PreTrainedModel) -> bool:
        """Whether the kept engine wraps ``model`` (whose layers are then not bare)."""
        with self._lock:
            return self._kept is not None and self._kept.model is model

    def drop(self) -> None:
        """Close the kept engine, if any: its model is bare again, its device memory can go."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept.engine.close()
