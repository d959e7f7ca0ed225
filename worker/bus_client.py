"""The worker's side of the bus: heartbeats (worker/heartbeat.py, a process of their own), batched loss reports and
stop commands.

A worker never touches the database: everything it knows comes in the pack message and through its
command stream, and everything it learns goes out on the scheduler stream (the messages: common/messages.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, TypeVar

from common.bus import SCHEDULER_STREAM, Bus, commands_stream
from common.messages import (
    AbortPack,
    AdmitTrials,
    PackReport,
    Point,
    Points,
    StopTrials,
    TrialCheckpoint,
    TrialFinished,
    TrialPayload,
    parse_command,
)
from worker import telemetry
from worker.heartbeat import Incarnation

log = logging.getLogger(__name__)

R = TypeVar("R", bound=PackReport)


class ReportsLost(RuntimeError):
    """The bus was away for so long that the reports waiting for it outgrew their bound: the pack stops."""


class Reporter:
    """Sends a pack's reports in order through a bounded outbox, so training goes on while the bus is away.

    Loss points are batched (≤ `max_points` or `flush_every_s`); other reports flush the batch first, so the
    scheduler always sees a trial's points before the trial's end. A report that cannot be sent waits in
    the outbox with everything after it; the outbox is retried with backoff (not on every step) and, once
    it holds more than `max_outbox` messages, `send` raises `ReportsLost`: the pack fails, its heartbeat
    then names no pack and the scheduler requeues its trials from their checkpoints.

    Every `trial.checkpoint` and `trial.finished` also repeats the trial's points since the checkpoint before
    its previous one (two checkpoint intervals), so points a restarted (emptied) Redis lost in flight are
    filled in even when the lost message was a checkpoint's own (ingest ignores repeats).
    """

    def __init__(self, bus: Bus, pack_id: str, worker_id: str, incarnation: Incarnation,
                 flush_every_s: float = 0.5, max_points: int = 500, max_outbox: int = 10_000) -> None:
        self.bus = bus
        self.pack_id = pack_id
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.flush_every_s = flush_every_s
        self.max_points = max_points
        self.max_outbox = max_outbox
        self._points: list[Point] = []
        self._recent: dict[str, list[Point]] = {}  # trial -> its points since the checkpoint before last
        self._checkpoint_step: dict[str, int] = {}  # trial -> its newest checkpoint's step
        self._last_flush = time.monotonic()
        self._outbox: deque[PackReport] = deque()
        self._retry_at = 0.0
        self._backoff_s = 0.0
        # Points come from the training thread, checkpoint and end reports from the pack's writer thread.
        self._lock = threading.RLock()

    def point(self, trial_id: str, step: int, split: str, loss: float) -> None:
        with self._lock:
            point = Point(trial_id, step, split, loss)
            self._points.append(point)
            self._recent.setdefault(trial_id, []).append(point)
            if len(self._points) >= self.max_points or time.monotonic() - self._last_flush >= self.flush_every_s:
                self.flush()

    def flush(self) -> None:
        with self._lock:
            self._last_flush = time.monotonic()
            if self._points:
                points, self._points = self._points, []
                self.send(Points, points=points)

    def send(self, kind: type[R], **fields: Any) -> None:
        """Sends a report of this pack: ``kind`` with ``fields`` (the pack, the worker process and the time are the
        reporter's)."""
        with self._lock:
            if kind is not Points:
                self.flush()
            if kind is TrialCheckpoint or kind is TrialFinished:
                fields["points"] = self._repeated_points(fields["trial_id"], fields.get("step"))
            self._outbox.append(kind(pack_id=self.pack_id, worker_id=self.worker_id, incarnation=self.incarnation.id,
                                     sent_at=time.time(), **fields))
            if time.monotonic() >= self._retry_at:
                self._drain()
            if len(self._outbox) > self.max_outbox:
                raise ReportsLost(f"{len(self._outbox)} reports could not be sent: the bus has been away too long")

    def _repeated_points(self, trial_id: str, checkpoint_step: int | None) -> list[Point]:
        """The points a checkpoint at `checkpoint_step` (None: the trial's end) repeats; from then on the trial
        keeps only those after its previous checkpoint."""
        points = self._recent.get(trial_id, [])
        if checkpoint_step is None:
            self._recent.pop(trial_id, None)
            self._checkpoint_step.pop(trial_id, None)
            return points
        previous = self._checkpoint_step.get(trial_id, 0)
        self._checkpoint_step[trial_id] = checkpoint_step
        self._recent[trial_id] = [p for p in points if p.step > previous]
        return [p for p in points if p.step <= checkpoint_step]

    def _locked_drain(self) -> bool:
        with self._lock:
            return self._drain()

    def _drain(self) -> bool:
        """Sends what waits, oldest first; True when nothing is left."""
        while self._outbox:
            try:
                self.bus.publish(SCHEDULER_STREAM, self._outbox[0].to_dict())
            except Exception as exc:  # noqa: BLE001 - any bus failure: keep it, try again later
                self._backoff_s = min(5.0, max(0.5, self._backoff_s * 2))
                self._retry_at = time.monotonic() + self._backoff_s
                log.warning("could not report to the scheduler (%s); %d reports wait, next try in %.1fs",
                            exc, len(self._outbox), self._backoff_s)
                return False
            self._outbox.popleft()
        self._backoff_s = 0.0
        return True

    def close(self, timeout_s: float) -> bool:
        """At the pack's end: waits up to `timeout_s` for every report to go out. False if some never did
        (the scheduler will not hear of them: past its heartbeat timeout it requeues the pack's trials)."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        while not self._locked_drain():
            if time.monotonic() >= deadline:
                log.error("pack %s: %d reports dropped, the bus stayed away for %.0fs", self.pack_id,
                          len(self._outbox), timeout_s)
                self._outbox.clear()
                return False
            time.sleep(max(0.0, min(self._retry_at, deadline) - time.monotonic()))
        return True


class CommandInbox:
    """Reads this worker's command stream (from the moment the worker started) at most every poll_s.

    Commands: ``stop_trials`` (pack id, trial ids, and a mode: ``drop`` by default, ``export`` to save the
    best-validation adapter first, ``pause`` to checkpoint and free the slot), ``admit_trials`` (pack id,
    trial payloads in the pack message's format: back-fills for a running pack's free slots) and
    ``abort_pack`` (the scheduler no longer counts on this pack: it was declared lost, its trials requeued).
    Admissions wait here per pack, each trial once, until the pack takes them or ends. A command that cannot be
    read (common/messages.py) is logged, counted and passed over.
    """

    OUTAGE_POLL_S = 5.0  # while the bus is away, each failed read would stall a training step: try less often

    def __init__(self, bus: Bus, worker_id: str, poll_s: float = 0.5) -> None:
        self.bus = bus
        self.stream = commands_stream(worker_id)
        self.poll_s = poll_s
        self._last_id = bus.tail_id(self.stream)
        self._last_poll = 0.0
        self._stopped: dict[str, dict[str, str]] = {}  # pack -> trial -> mode
        self._admissions: dict[str, dict[str, TrialPayload]] = {}  # pack -> trial id -> payload
        self._seen_admissions: set[tuple[str, str, str]] = set()  # (pack, trial, placement)
        self._aborted: set[str] = set()

    def _poll(self) -> None:
        if time.monotonic() - self._last_poll < self.poll_s:
            return
        self._last_poll = time.monotonic()
        try:
            messages = self.bus.read_after(self.stream, self._last_id, count=100, block_s=0)
        except Exception as exc:  # noqa: BLE001 - the bus is away: train on, read the commands later
            log.warning("could not read this worker's commands (%s); next try in %.0fs", exc, self.OUTAGE_POLL_S)
            self._last_poll = time.monotonic() + self.OUTAGE_POLL_S - self.poll_s
            return
        for msg_id, raw in messages:
            self._last_id = msg_id  # past it whether or not it can be read: read again it would fail again
            command = parse_command(raw, on_drop=telemetry.message_dropped)
            if isinstance(command, AbortPack):
                self._aborted.add(command.pack_id)
            elif isinstance(command, StopTrials):
                stops = self._stopped.setdefault(command.pack_id, {})
                stops.update((trial_id, command.mode) for trial_id in command.trial_ids if trial_id not in stops)
            elif isinstance(command, AdmitTrials):
                self._admit(command)

    def _admit(self, command: AdmitTrials) -> None:
        pack_id = command.pack_id
        queue = self._admissions.setdefault(pack_id, {})
        for trial in command.trials:
            # A command re-sent after a scheduler restart repeats its placement: taken once. A trial paused and
            # placed again in the same pack is a new placement, and its old stop is void.
            key = (pack_id, trial.trial_id, str(trial.placed_at))
            if key not in self._seen_admissions:
                self._seen_admissions.add(key)
                queue[trial.trial_id] = trial
                self._stopped.get(pack_id, {}).pop(trial.trial_id, None)

    def aborted(self, pack_id: str) -> bool:
        self._poll()
        return pack_id in self._aborted

    def stopped_trials(self, pack_id: str) -> dict[str, str]:
        """Trials of ``pack_id`` to take out, each with its mode (the first command for a trial wins)."""
        self._poll()
        return dict(self._stopped.get(pack_id, {}))

    def take_admissions(self, pack_id: str, limit: int) -> list[TrialPayload]:
        """Up to ``limit`` trials waiting to join ``pack_id``, oldest first (removed from the inbox)."""
        self._poll()
        queue = self._admissions.get(pack_id, {})
        taken = list(queue)[: max(0, limit)]
        return [queue.pop(trial_id) for trial_id in taken]

    def drain_admissions(self, pack_id: str) -> list[TrialPayload]:
        """Every trial still waiting to join ``pack_id`` (the pack is ending: they will be refused)."""
        self._last_poll = 0.0  # read the newest commands too
        self._poll()
        return list(self._admissions.pop(pack_id, {}).values())
