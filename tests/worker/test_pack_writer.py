"""The pack's writer (worker/engine/writer.py): ordered work in order, at most one waiting checkpoint per trial
(newest first, superseded ones dropped), a trial's end dropping its waiting one, failures raised on the caller's
thread. Work blocks on Events, never on sleeps."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from worker.engine.writer import PackWriter, WriterCounts


def blocker() -> tuple[threading.Event, threading.Event, Callable[[], None]]:
    """Work that says it started and then waits to be released."""
    started, release = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        assert release.wait(30)

    return started, release, work


def test_a_newer_snapshot_supersedes_a_waiting_one_and_the_newest_goes_first() -> None:
    writer, done = PackWriter(), []
    started, release, block = blocker()
    writer.submit(block)
    assert started.wait(30)  # the writer is busy: everything below waits
    for step in (1, 2, 3):
        writer.offer("a", lambda step=step: done.append(("a", step)))
    writer.offer("b", lambda: done.append(("b", 1)))
    writer.offer("c", lambda: done.append(("c", 1)))
    writer.discard("c")  # its trial ended
    writer.submit(lambda: done.append(("outcome", 0)))
    release.set()
    writer.close()
    # Ordered work first, then the newest offer first; a's 1 and 2 were superseded, c's was discarded.
    assert done == [("outcome", 0), ("b", 1), ("a", 3)]
    assert writer.counts == WriterCounts(offered=5, done=2, dropped=3)


def test_an_offer_under_way_is_not_dropped() -> None:
    writer, done = PackWriter(), []
    started, release, block = blocker()
    writer.offer("a", block)
    assert started.wait(30)
    writer.discard("a")  # nothing waits: the one under way finishes
    writer.offer("a", lambda: done.append(2))
    release.set()
    writer.close()
    assert done == [2] and writer.counts == WriterCounts(offered=2, done=2, dropped=0)


def test_a_failure_is_raised_once_on_the_callers_thread_and_the_rest_still_runs() -> None:
    writer, done = PackWriter(), []
    finished = threading.Event()

    def fails() -> None:
        raise OSError("the artifact store is away")

    writer.submit(fails)
    writer.submit(lambda: (done.append("after"), finished.set()))
    assert finished.wait(30)
    with pytest.raises(OSError, match="store is away"):
        writer.poll()
    writer.poll()  # raised already
    writer.close()
    assert done == ["after"]


def test_close_runs_what_waits_and_raises_a_failure_not_raised_yet() -> None:
    writer, done = PackWriter(), []
    started, release, block = blocker()
    writer.submit(block)
    assert started.wait(30)
    writer.offer("a", lambda: done.append("a"))
    writer.offer("b", lambda: 1 / 0)
    release.set()
    with pytest.raises(ZeroDivisionError):
        writer.close()
    assert done == ["a"] and writer.idle()
