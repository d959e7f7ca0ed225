"""A pack's writer: the files a pack writes (checkpoints, adapters) and the callbacks after them, on one background
thread, so that the training thread never waits for the disk or the artifact store.

Two kinds of work. ``submit``: work that must run, in submission order (an adapter's files, then the trial's
outcome report; a paused trial's checkpoint, then its report). ``offer``: a trial's periodic checkpoint, which a newer
one of the same trial supersedes: at most one waits per trial, a newer one replaces it unstarted (a drop), and a
trial that ends takes its waiting one with it (``discard``). Submitted work goes first; then the newest waiting
checkpoint. A failure is kept and raised on the training thread (``poll``, ``close``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Work = Callable[[], object]


@dataclass
class WriterCounts:
    """What became of the offered checkpoints."""

    offered: int = 0
    done: int = 0  # started and finished, well or not
    dropped: int = 0  # replaced by a newer one of their trial, or discarded with their trial, before they started


@dataclass
class _Queue:
    """The writer's state, guarded by its condition (pure bookkeeping: the thread and the locks are the writer's)."""

    ordered: deque[Work] = field(default_factory=deque)
    offers: dict[str, tuple[int, Work]] = field(default_factory=dict)  # key -> (sequence number, work)
    sequence: int = 0
    counts: WriterCounts = field(default_factory=WriterCounts)

    def offer(self, key: str, work: Work) -> None:
        self.counts.offered += 1
        self.sequence += 1
        if self.offers.pop(key, None) is not None:
            self.counts.dropped += 1
        self.offers[key] = (self.sequence, work)

    def discard(self, key: str) -> None:
        if self.offers.pop(key, None) is not None:
            self.counts.dropped += 1

    def next(self) -> tuple[Work, bool] | None:
        """The next work and whether it was offered: the oldest submitted, else the newest offered; None: none."""
        if self.ordered:
            return self.ordered.popleft(), False
        if not self.offers:
            return None
        key = max(self.offers, key=lambda k: self.offers[k][0])
        return self.offers.pop(key)[1], True


class PackWriter:
    """One pack's background writer (see the module's docstring). ``close`` ends it."""

    def __init__(self, name: str = "pack-writer") -> None:
        self._queue = _Queue()
        self._changed = threading.Condition()
        self._closing = False
        self._busy = False
        self._failures: list[BaseException] = []
        self._raised = 0  # failures already raised on the training thread
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def counts(self) -> WriterCounts:
        with self._changed:
            return WriterCounts(**vars(self._queue.counts))

    def submit(self, work: Work) -> None:
        """Run ``work`` after all work submitted before it (and before any offered work that has not started)."""
        with self._changed:
            self._queue.ordered.append(work)
            self._changed.notify_all()

    def offer(self, key: str, work: Work) -> None:
        """Run ``work`` unless a newer offer of ``key`` (or ``discard(key)``) comes before it starts."""
        with self._changed:
            self._queue.offer(key, work)
            self._changed.notify_all()

    def discard(self, key: str) -> None:
        """Drop the offer of ``key`` that has not started (one under way finishes)."""
        with self._changed:
            self._queue.discard(key)

    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        with self._changed:
            return not self._busy and not self._queue.ordered and not self._queue.offers

    def poll(self) -> None:
        """Raise the first failure of the writer's work not raised yet."""
        with self._changed:
            if self._raised < len(self._failures):
                first = self._failures[self._raised]
                self._raised = len(self._failures)
                raise first

    def close(self) -> None:
        """Run everything still waiting, end the thread, then raise a failure not raised yet."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        self.poll()

    def _loop(self) -> None:
        while True:
            with self._changed:
                while (taken := self._queue.next()) is None and not self._closing:
                    self._changed.wait()
                if taken is None:
                    return
                self._busy = True
            work, offered = taken
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread instead
                with self._changed:
                    self._failures.append(exc)
            finally:
                with self._changed:
                    self._busy = False
                    self._queue.counts.done += offered
                    self._changed.notify_all()
