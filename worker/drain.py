"""What SIGTERM (or Ctrl+C) does to a worker: it drains (issue 52).

Celery's warm shutdown alone waits for the task in flight, a whole pack (hours on a real one), and the orchestrator's
SIGKILL at the end of its grace period lost everything since each trial's last checkpoint. Now the signal starts a
drain:

1. a heartbeat goes out at once saying the worker drains (`draining`): the scheduler gives it no pack from then on
   (`states.WORKER_DRAINING`), and no back-fill reaches its packs;
2. the shared `DrainFlag` is set, which every process that trains reads at each step (the worker process's runner,
   its pack processes, its ranks): each running trial is paused at its next step boundary, its snapshot persisted
   before its end is reported as `paused` with `drained` (worker/pack_runner.py), and the scheduler puts it back in
   pending at once, no attempt spent (scheduler/service/ingest.py); the pack then ends as usual (`pack.finished`), a
   pack arriving meanwhile is refused, and Celery, in its warm shutdown, exits;
3. at `LORAPLANE_WORKER_DRAIN_S` after the signal (`Drain.bound_s`, within Kubernetes' default grace of 30 s) a worker
   still running gives up: its heartbeat process stops, one last beat names none of its packs (the scheduler ends
   them at once, their trials requeued from their last checkpoint as for a lost worker), and the process exits with
   status 1. That happens when a step, a model load or an export outlasts the bound: a step is never cut short.

The signal is read from the interpreter's wakeup fd (`listen_for_signals`) on a thread of its own, not from a Python
signal handler: those run in the main thread between two bytecodes, which a long step in C may hold for a while, and
the bound must hold whatever the main thread does. Celery's own handler still runs there and starts its warm shutdown.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DRAIN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
GAVE_UP_STATUS = 1  # the exit status of a worker that was still running at the bound
ANNOUNCE_WAIT_S = 2.0  # how long the trials wait for the draining beat to go out before they pause anyway


class DrainFlag:
    """Whether the worker drains, in memory shared with the processes it spawns (passed to them at their start): set
    once, by the worker process, read at every step. No lock: a read never waits and a set never blocks."""

    def __init__(self) -> None:
        self._value = multiprocessing.get_context("spawn").RawValue(ctypes.c_bool, False)

    def set(self) -> None:
        self._value.value = True

    def is_set(self) -> bool:
        return bool(self._value.value)


def listen_for_signals(on_signal: Callable[[int], None]) -> None:
    """Calls ``on_signal(signal number)`` from a thread of its own for every signal this process receives that has a
    Python handler (Celery's, once its worker starts), as soon as it arrives, whatever the main thread does. Call it
    from the main thread (the interpreter's wakeup fd is set there)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def read() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                on_signal(signum)

    threading.Thread(target=read, name="signal-listener", daemon=True).start()


class Drain:
    """The worker process's drain: `signalled` starts it once (the module's docstring says what follows).

    ``announce`` tells the scheduler that the worker drains (`Heartbeat.drain`); ``give_up`` tells it, at the bound,
    that none of the worker's packs runs any more (`Heartbeat.abandon`); ``exit`` ends the process (``os._exit``: at
    the bound the main thread may be anywhere)."""

    def __init__(self, flag: DrainFlag, bound_s: float, announce: Callable[[], None], give_up: Callable[[], None],
                 exit: Callable[[int], None] = os._exit) -> None:
        self.flag = flag
        self.bound_s = bound_s
        self._announce = announce
        self._give_up = give_up
        self._exit = exit
        self._lock = threading.Lock()
        self.started_at: float | None = None  # time.monotonic() at the signal

    def signalled(self, signum: int) -> None:
        if signum in DRAIN_SIGNALS:
            self.begin(f"signal {signal.Signals(signum).name}")

    def begin(self, why: str) -> None:
        """Starts the drain (once; a second signal changes nothing here: Celery's handler makes it a cold or hard
        shutdown)."""
        with self._lock:
            if self.started_at is not None:
                return
            self.started_at = time.monotonic()
        log.warning("%s: draining; running trials are checkpointed and handed back at their next step, and the worker "
                    "exits within %.0fs", why, self.bound_s)
        deadline = threading.Timer(self.bound_s, self._at_bound)
        deadline.daemon = True
        deadline.start()
        threading.Thread(target=self._pause_trials, name="drain", daemon=True).start()

    def _pause_trials(self) -> None:
        """The draining beat first, so that the scheduler hears of the drain before the trials' pauses; a bus that
        does not take it within ``ANNOUNCE_WAIT_S`` delays the pauses no longer."""
        announcing = threading.Thread(target=self._announce_safely, name="drain-announce", daemon=True)
        announcing.start()
        announcing.join(ANNOUNCE_WAIT_S)
        self.flag.set()

    def _announce_safely(self) -> None:
        try:
            self._announce()
        except Exception:  # noqa: BLE001 - the trials pause all the same; the scheduler learns from their reports
            log.exception("could not tell the scheduler that this worker drains")

    def _at_bound(self) -> None:
        log.error("still running %.0fs after the drain began: giving up; the trials not handed back resume from their "
                  "last checkpoint", self.bound_s)
        try:
            self._give_up()
        except Exception:  # noqa: BLE001 - exit all the same: the scheduler's worker timeout ends the packs then
            log.exception("could not tell the scheduler that this worker's packs are gone")
        logging.shutdown()
        self._exit(GAVE_UP_STATUS)
