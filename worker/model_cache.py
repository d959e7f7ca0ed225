"""A worker's warm base models: each loaded once and kept on its device across packs, the least recently used
evicted when loading another would pass the budget (issue 30).

A copy is kept under its registry name with the entry it was loaded from (`ModelSource`) and that entry's revision
(`model_revision`: its files' sizes and modification times). A pack of the same entry and files takes the warm copy;
another entry under the name (an operator's PATCH: another path) or other files (rewritten in place) load again,
replacing the old copy. Memory: each copy's parameters and buffers, their bytes on this process's device (on a rank
of a worker over several GPUs: its shards and the layers kept whole), against `LORAPLANE_WORKER_MODEL_CACHE_BYTES`
(0: half of the device's memory). The pack being set up shares its device with the other warm copies, up to the
budget; its measured peak memory (its profile) includes them.

Which copies to evict is pure (`evictions`); `ModelCache` loads, frees and says what is warm (the heartbeat's
`warm_models`).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from common.registry import DEFAULT_MODELS
from common.tiny_tokenizer import TINY_TOKENIZER
from worker.engine import ModelSource
from worker.engine.base_model import model_revision

log = logging.getLogger(__name__)


def device_memory(device: torch.device) -> int:
    """The memory of ``device``: one GPU's, or the host's for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cache_budget(configured: int, device: torch.device) -> int:
    """``LORAPLANE_WORKER_MODEL_CACHE_BYTES``, or half of the device's memory where it is 0."""
    return configured or device_memory(device) // 2


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers held by this process (a sharded parameter: its local shard; a
    tied weight once)."""
    total = 0
    for tensor in chain(model.parameters(), model.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor (FSDP2's shards)
        total += local.numel() * local.element_size()
    return total


@dataclass(frozen=True)
class Resident:
    """A warm copy as the eviction policy sees it."""

    name: str
    bytes: int
    last_used_at: float


def evictions(resident: Sequence[Resident], *, incoming_bytes: int, budget_bytes: int,
              keep: Collection[str] = ()) -> list[str]:
    """The names to evict, least recently used first, so that ``resident`` and ``incoming_bytes`` more fit in
    ``budget_bytes``. ``keep`` (the model being returned, and those a running pack uses) never goes: a model larger
    than the budget alone is kept, the only one (a pack needs it)."""
    total = incoming_bytes + sum(r.bytes for r in resident)
    out: list[str] = []
    for r in sorted(resident, key=lambda r: (r.last_used_at, r.name)):
        if total <= budget_bytes:
            break
        if r.name not in keep:
            out.append(r.name)
            total -= r.bytes
    return out


@dataclass(frozen=True)
class Loaded:
    """A base model and its tokenizer, whether they were warm, and the seconds spent loading them (0 when warm)."""

    model: Any
    tokenizer: Any
    warm: bool
    load_s: float


@dataclass
class _Copy:
    source: ModelSource
    revision: str
    model: Any
    tokenizer: Any
    bytes: int
    last_used_at: float  # epoch seconds


class ModelCache:
    """The warm copies of one worker process, or of one pack process (see the module docstring; a pack process
    keeps its last pack's model alone: worker/pack_processes.py). ``load`` loads a model onto the device
    (``PackRunner``'s: onto its device, or on the host and sharded on a rank); ``on_evict`` lets go of what else
    holds a copy that goes (the engine kept around its layers). ``get`` runs on the pack's thread; ``warm`` on
    the heartbeat's.

    ``get`` is safe from several threads: a copy a pack uses is held (``get(..., hold=True)`` until ``release``)
    and never evicted to make room for another's."""

    def __init__(self, load: Callable[[ModelSource], tuple[Any, Any]], *, budget_bytes: int,
                 device: torch.device, on_evict: Callable[[Any], None] | None = None) -> None:
        self._load = load
        self.budget_bytes = budget_bytes
        self.device = device
        self._on_evict = on_evict
        self._copies: dict[str, _Copy] = {}  # by registry name
        self._known_bytes: dict[str, int] = {}  # name -> its copy's bytes when last loaded (to make room first)
        self._lock = threading.Lock()
        # One load at a time: loading a model sets process-wide state (transformers builds it on the meta device
        # under context managers that are not per thread), and two loads at once on threads of one process failed
        # both ("Cannot copy out of meta tensor").
        self._loading = threading.Lock()
        self._held: Counter[str] = Counter()  # name -> the running packs that use its copy
        self.loads = 0  # every load it made (the tests count them)

    def get(self, source: ModelSource, *, hold: bool = False) -> Loaded:
        """``source``'s model and tokenizer: the warm copy, or loaded now (other copies evicted first as far as
        its size is known from an earlier load, then as far as its measured size needs; never one held). ``hold``:
        the copy stays until ``release(source.name)`` (a pack's life), whatever else is loaded meanwhile.

        Raises whatever loading raises (a missing file, a model the device cannot hold beside nothing else)."""
        revision = model_revision(source)
        with self._lock:
            copy = self._copies.get(source.name)
            if copy is not None and copy.source == source and copy.revision == revision:
                copy.last_used_at = time.time()
                self._held[source.name] += hold
                return Loaded(copy.model, copy.tokenizer, warm=True, load_s=0.0)
        if copy is not None:
            log.info("base model %s changed (its registry entry or its files); loading it again", source.name)
            self._evict([source.name])
            del copy  # the old copy's memory can go before the new one comes
        started = time.perf_counter()
        with self._loading:
            self._evict(self._to_evict(self._known_bytes.get(source.name, 0), keep=None))
            model, tokenizer = self._load_making_room(source)
        load_s = time.perf_counter() - started
        size = resident_bytes(model)
        with self._lock:
            self._copies[source.name] = _Copy(source, revision, model, tokenizer, size, time.time())
            self._known_bytes[source.name] = size
            self._held[source.name] += hold
            self.loads += 1
        self._evict(self._to_evict(0, keep=source.name))
        log.info("base model %s loaded on %s in %.1fs (%.0f MB; %d warm)", source.name, self.device, load_s,
                 size / 1e6, len(self._copies))
        return Loaded(model, tokenizer, warm=False, load_s=load_s)

    def _load_making_room(self, source: ModelSource) -> tuple[Any, Any]:
        """Load ``source``; a device out of memory evicts every other copy no pack holds and loads once more."""
        try:
            return self._load(source)
        except torch.OutOfMemoryError:
            with self._lock:
                idle = [name for name in self._copies if not self._held[name]]
            if not idle:
                raise
            log.warning("the device ran out of memory loading %s: evicting every other warm model no pack uses",
                        source.name)
        self._evict(idle)
        return self._load(source)

    def release(self, name: str) -> None:
        """A pack that held ``name``'s copy (``get(..., hold=True)``) is done with it."""
        with self._lock:
            if self._held[name] > 1:
                self._held[name] -= 1
            else:
                self._held.pop(name, None)

    def _to_evict(self, incoming_bytes: int, keep: str | None) -> list[str]:
        with self._lock:
            resident = [Resident(name, c.bytes, c.last_used_at) for name, c in self._copies.items()]
            held = {name for name, n in self._held.items() if n > 0} | ({keep} if keep else set())
        return evictions(resident, incoming_bytes=incoming_bytes, budget_bytes=self.budget_bytes, keep=held)

    def _evict(self, names: list[str]) -> None:
        """Drop the copies named: no reference of this cache is left, the garbage is collected (a model's modules
        refer to each other) and the device's cached blocks are given back."""
        if not names:
            return
        with self._lock:
            gone = [self._copies.pop(name) for name in names if name in self._copies]
        while gone:
            copy = gone.pop()
            log.info("evicting warm base model %s (%.0f MB)", copy.source.name, copy.bytes / 1e6)
            if self._on_evict is not None:
                self._on_evict(copy.model)
            del copy
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_idle(self) -> None:
        """Evicts every copy no pack holds."""
        with self._lock:
            idle = [name for name in self._copies if not self._held[name]]
        self._evict(idle)

    def warm(self) -> list[dict[str, Any]]:
        """The warm copies, most recently used first, as the heartbeat's ``warm_models`` carries them."""
        with self._lock:
            copies = sorted(self._copies.values(), key=lambda c: c.last_used_at, reverse=True)
            return [{"name": c.source.name, "revision": c.revision, "bytes": c.bytes, "last_used_at": c.last_used_at}
                    for c in copies]


def model_source(fields: Mapping[str, Any]) -> ModelSource:
    """The engine's source of a registry entry's fields (`common.registry.model_source_fields`, as a pack message
    carries them); the synthetic model gets its tokenizer's one definition (common/tiny_tokenizer.py)."""
    tokenizer = TINY_TOKENIZER if fields.get("kind") == "tiny-random-llama" else None
    return ModelSource(**fields, tokenizer=tokenizer)


def preload_models(load: Callable[[ModelSource], object], names: str,
                   registry: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Load the named registry models now with ``load`` (``PackRunner.model``: into its warm models, as a pack would,
    within LORAPLANE_WORKER_MODEL_CACHE_BYTES: of more than fit, the last named stay); ``names`` is
    ``LORAPLANE_WORKER_PRELOAD``. A name is looked up in ``registry`` (the one the scheduler published, with
    the models an operator registered), then among the default models; an unknown name is logged and skipped,
    and so is a model that fails to load (its packs will say why)."""
    sources = {m.name: model_source({"name": m.name, "kind": m.kind, "path": m.path, "package": m.package,
                                     "gguf_file": m.gguf_file}) for m in DEFAULT_MODELS}
    for name, fields in (registry or {}).items():
        sources[name] = model_source(fields)
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in sources:
            log.warning("LORAPLANE_WORKER_PRELOAD: %r is not a registered model; not preloaded", name)
            continue
        try:
            load(sources[name])
        except Exception:  # noqa: BLE001 - the worker still serves the models it can load
            log.exception("LORAPLANE_WORKER_PRELOAD: %r could not be loaded", name)
