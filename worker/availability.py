"""Which registered models this machine can load: what a worker's heartbeat says of itself.

The scheduler publishes the model registry on the bus (`REGISTRY_KEY`: each model not retired, by name, with
the fields of its source); the worker checks every entry against its own disks and Python environment, without
loading anything and without importing torch, and names the loadable ones in each heartbeat. The planner
places a model's trials only on workers that name it (scheduler/planning/types.py, `LiveWorker.models`).

A check touches the disk (a directory, a config.json, a package lookup), so its answer is kept for `ttl_s`
seconds per (name, source fields): a beat costs one read of the registry from the bus, and a model directory
mounted later is noticed within `ttl_s`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from common.bus import REGISTRY_KEY, Bus

log = logging.getLogger(__name__)

CHECK_TTL_S = 15.0


def can_load(fields: Mapping[str, Any]) -> bool:
    """Whether the model whose source is ``fields`` (`common.registry.model_source_fields`) loads here, judged
    as worker/engine/base_model.py's `load_base_model` would find it, without loading it:

    - ``tiny-random-llama``: always (synthetic, materialised on first use);
    - ``hf``: ``path`` is a directory whose config.json parses as a JSON object;
    - ``gguf``: the file ``gguf_file`` is in the directory ``path``;
    - ``gguf-package``: the package ``package`` is installed (located with ``find_spec``, never imported: model
      packages import optional dependencies from their ``__init__``) and ``gguf_file`` is in its folder.

    Anything else (an unknown kind, a missing field, an unreadable file) cannot be loaded.
    """
    kind = fields.get("kind")
    path, package, gguf_file = (str(fields.get(k) or "") for k in ("path", "package", "gguf_file"))
    try:
        if kind == "tiny-random-llama":
            return True
        if kind == "hf":
            if not path or not Path(path).is_dir():
                return False
            return isinstance(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")), dict)
        if kind == "gguf":
            return bool(path and gguf_file) and (Path(path) / gguf_file).is_file()
        if kind == "gguf-package":
            if not package or not gguf_file:
                return False
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                return False
            return (Path(list(spec.submodule_search_locations)[0]) / gguf_file).is_file()
    except (OSError, ValueError, ImportError):  # unreadable, not JSON, a dotted package whose parent is missing
        return False
    return False


class ModelAvailability:
    """The registry's models this worker can load, for its heartbeat (`models`), each check kept `ttl_s`."""

    def __init__(self, bus: Bus, *, ttl_s: float = CHECK_TTL_S, clock: Callable[[], float] = time.monotonic,
                 check: Callable[[Mapping[str, Any]], bool] = can_load) -> None:
        self.bus = bus
        self.ttl_s = ttl_s
        self._clock = clock
        self._check = check
        self._registry: dict[str, dict[str, Any]] | None = None  # the newest registry read
        self._checked: dict[tuple[str, str], tuple[float, bool]] = {}  # (name, fields as JSON) -> (when, loadable)
        self._said: list[str] | None = None

    def registry(self) -> dict[str, dict[str, Any]] | None:
        """The newest registry published (None: none yet). While the bus is away, or forgot the key (an emptied
        Redis, until the scheduler publishes it again), the last one read."""
        try:
            published = self.bus.get(REGISTRY_KEY)
        except Exception as exc:  # noqa: BLE001 - the bus blinked: the last registry read still holds
            log.warning("could not read the model registry (%s); using the last one read", exc)
            published = None
        if published is not None and isinstance(published.get("models"), dict):
            self._registry = {str(name): dict(fields) for name, fields in published["models"].items()
                              if isinstance(fields, dict)}
        return self._registry

    def models(self) -> list[str] | None:
        """The names of the registry's models that load here, sorted; None while no registry was published (the
        heartbeat then does not say, and the scheduler takes the worker as able to load every model)."""
        registry = self.registry()
        if registry is None:
            return None
        now = self._clock()
        checked: dict[tuple[str, str], tuple[float, bool]] = {}
        for name, fields in registry.items():
            key = (name, json.dumps(fields, sort_keys=True))
            at, ok = self._checked.get(key, (float("-inf"), False))
            if now - at >= self.ttl_s:
                at, ok = now, self._check(fields)
            checked[key] = (at, ok)
        self._checked = checked  # entries of models no longer published go
        loadable = sorted(name for (name, _), (_, ok) in checked.items() if ok)
        if loadable != self._said:
            missing = sorted(set(registry) - set(loadable))
            log.info("this worker can load %s%s", ", ".join(loadable) or "no registered model",
                     f"; not {', '.join(missing)}" if missing else "")
            self._said = loadable
        return loadable
