"""A hollow worker's pack runner: the real `PackRunner` (claims, co-location ledger, commands, reports, checkpoint and
adapter files in the artifact store) with the hollow engine as its ``train`` and a model cache that loads nothing."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from common.artifacts import LocalArtifactStore
from common.bus import Bus
from worker.drain import DrainFlag
from worker.engine import ModelSource
from worker.heartbeat import Heartbeat
from worker.hollow.engine import DEPARTURES, HOLLOW_MARKER, HollowBase, HollowEngine
from worker.model_cache import Loaded, ModelCache
from worker.pack_runner import PackRunner

WARM_MODELS = 2  # the base models a hollow worker says it holds warm: its last packs'


class HollowModels(ModelCache):
    """A model cache that loads nothing: every base model is a `HollowBase` at once (no files are read, so a hollow
    worker takes a pack of any registered model), and the last `WARM_MODELS` used are what its beats call warm (the
    planner's tie-breaker sees them as a real worker's)."""

    def __init__(self) -> None:
        super().__init__(lambda source: (HollowBase(source.name), None), budget_bytes=0, device=torch.device("cpu"))
        self._used: dict[str, float] = {}  # name -> last used (epoch seconds)
        self._used_lock = threading.Lock()

    def get(self, source: ModelSource, *, hold: bool = False) -> Loaded:
        with self._used_lock:
            warm = source.name in self._used
            self._used[source.name] = time.time()
            for name in sorted(self._used, key=self._used.__getitem__, reverse=True)[WARM_MODELS:]:
                del self._used[name]
        return Loaded(HollowBase(source.name), None, warm=warm, load_s=0.0)

    def release(self, name: str) -> None:
        pass

    def drop_idle(self) -> None:
        with self._used_lock:
            self._used.clear()

    def warm(self) -> list[dict[str, Any]]:
        with self._used_lock:
            return [{"name": name, "revision": "hollow", "bytes": 0, "last_used_at": at}
                    for name, at in sorted(self._used.items(), key=lambda item: item[1], reverse=True)]


def hollow_runner(*, worker_id: str, bus: Bus, store: LocalArtifactStore, heartbeat: Heartbeat, engine: HollowEngine,
                  memory_bytes: int, max_packs: int, drain: DrainFlag, report_timeout_s: float, model_cache_dir: Path,
                  device: str) -> PackRunner:
    """The runner of one hollow worker: ``device`` (e.g. ``hollow:H200``) is what its pack profiles name, with the
    hollow engine's departures and settings beside their measurements."""
    runner = PackRunner(worker_id=worker_id, device=torch.device("cpu"), bus=bus, store=store,
                        model_cache_dir=model_cache_dir, heartbeat=heartbeat, report_timeout_s=report_timeout_s,
                        model_cache_bytes=0, max_packs=max_packs, memory_bytes=memory_bytes, drain=drain,
                        train=engine.train_pack)
    runner.models = HollowModels()
    runner.profile_notes = {"device": device, HOLLOW_MARKER: {
        "time_scale": engine.timing.time_scale, "noise": engine.timing.noise, "departures": list(DEPARTURES),
        "seconds": "the cost model's step times, not measured ones"}}
    return runner
