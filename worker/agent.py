"""The worker's side of the bus: heartbeats, batched loss reports and stop commands.

A worker never touches the database: everything it knows comes in the pack message and through its
command stream, and everything it learns goes out on the scheduler stream.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from common.bus import SCHEDULER_STREAM, Bus, commands_stream

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    """Publishes the worker's presence every `interval_s`; the scheduler declares it lost when it stops."""

    def __init__(self, bus: Bus, interval_s: float, identity: dict[str, Any]) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.bus = bus
        self.interval_s = interval_s
        self.identity = identity
        self.current_pack_id: str | None = None
        self._stop = threading.Event()

    def beat(self) -> None:
        self.bus.publish(SCHEDULER_STREAM, {"type": "heartbeat", **self.identity, "pack_id": self.current_pack_id})

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the bus may blink; the next beat retries
                log.warning("heartbeat failed", exc_info=True)
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


class Reporter:
    """Buffers loss points and sends them in batches; other reports flush the buffer first, so the
    scheduler always sees a trial's points before the trial's end."""

    def __init__(self, bus: Bus, pack_id: str, worker_id: str, flush_every_s: float = 0.5,
                 max_points: int = 500) -> None:
        self.bus = bus
        self.pack_id = pack_id
        self.worker_id = worker_id
        self.flush_every_s = flush_every_s
        self.max_points = max_points
        self._points: list[list[Any]] = []
        self._last_flush = time.monotonic()

    def point(self, trial_id: str, step: int, split: str, loss: float) -> None:
        self._points.append([trial_id, step, split, loss])
        if len(self._points) >= self.max_points or time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if self._points:
            points, self._points = self._points, []
            self.send("points", points=points)

    def send(self, kind: str, **fields: Any) -> None:
        if kind != "points":
            self.flush()
        self.bus.publish(SCHEDULER_STREAM, {"type": kind, "pack_id": self.pack_id, "worker_id": self.worker_id,
                                            **fields})


class CommandInbox:
    """Reads this worker's command stream (from the moment the worker started) at most every poll_s.

    Commands: ``stop_trials`` (pack id, trial ids, and a mode: ``drop`` by default, ``export`` to save the
    best-validation adapter first, ``pause`` to checkpoint and free the slot) and ``admit_trials`` (pack id,
    trial payloads in the pack message's format: back-fills for a running pack's free slots). Admissions
    wait here per pack, each trial once, until the pack takes them or ends.
    """

    def __init__(self, bus: Bus, worker_id: str, poll_s: float = 0.5) -> None:
        self.bus = bus
        self.stream = commands_stream(worker_id)
        self.poll_s = poll_s
        self._last_id = bus.tail_id(self.stream)
        self._last_poll = 0.0
        self._stopped: dict[str, dict[str, str]] = {}  # pack -> trial -> mode
        self._admissions: dict[str, dict[str, dict[str, Any]]] = {}  # pack -> trial id -> payload
        self._seen_admissions: set[tuple[str, str, str]] = set()  # (pack, trial, placement)

    def _poll(self) -> None:
        if time.monotonic() - self._last_poll < self.poll_s:
            return
        self._last_poll = time.monotonic()
        for msg_id, message in self.bus.read_after(self.stream, self._last_id, count=100, block_s=0):
            self._last_id = msg_id
            if message.get("type") == "stop_trials":
                mode = message.get("mode", "drop")
                stops = self._stopped.setdefault(message["pack_id"], {})
                stops.update((trial_id, mode) for trial_id in message["trial_ids"] if trial_id not in stops)
            elif message.get("type") == "admit_trials":
                pack_id = message["pack_id"]
                queue = self._admissions.setdefault(pack_id, {})
                for trial in message["trials"]:
                    # A command re-sent after a scheduler restart repeats its placement: taken once. A trial
                    # paused and placed again in the same pack is a new placement, and its old stop is void.
                    key = (pack_id, trial["trial_id"], str(trial.get("placed_at")))
                    if key not in self._seen_admissions:
                        self._seen_admissions.add(key)
                        queue[trial["trial_id"]] = trial
                        self._stopped.get(pack_id, {}).pop(trial["trial_id"], None)

    def stopped_trials(self, pack_id: str) -> dict[str, str]:
        """Trials of ``pack_id`` to take out, each with its mode (the first command for a trial wins)."""
        self._poll()
        return dict(self._stopped.get(pack_id, {}))

    def take_admissions(self, pack_id: str, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` trials waiting to join ``pack_id``, oldest first (removed from the inbox)."""
        self._poll()
        queue = self._admissions.get(pack_id, {})
        taken = list(queue)[: max(0, limit)]
        return [queue.pop(trial_id) for trial_id in taken]

    def drain_admissions(self, pack_id: str) -> list[dict[str, Any]]:
        """Every trial still waiting to join ``pack_id`` (the pack is ending: they will be refused)."""
        self._last_poll = 0.0  # read the newest commands too
        self._poll()
        return list(self._admissions.pop(pack_id, {}).values())
