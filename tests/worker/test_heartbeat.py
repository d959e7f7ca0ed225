"""The heartbeat that training cannot starve (issue 32): a process of its own (worker/heartbeat.py), which beats while
its worker process holds the GIL and every core is busy, and ends with its worker (killed included). Real processes,
the real scheduler daemon on the real Postgres and Redis, with a short worker timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import states
from common.bus import SCHEDULER_STREAM, get_bus
from common.celery import get_celery
from common.db import session_scope
from common.settings import get_settings
from common.tables import Worker
from scheduler.service.daemon import SchedulerDaemon
from tests.e2e.procs import START_CEILING_S
from worker.heartbeat import BeatState, ProgressClock

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 4.0  # the worker timeout here: a starved beat would be missed within seconds
# The worker process: a real `Heartbeat`, started as `run_worker` starts it; then, on a line from the test, it holds
# its GIL for `hold_s` (a call through `PyDLL` never lets go of it: no thread of this process runs meanwhile).
WORKER_SCRIPT = """
import ctypes, sys, time
from common.bus import get_bus
from worker.heartbeat import Heartbeat, Incarnation
worker_id, hold_s = sys.argv[1], int(sys.argv[2])
heartbeat = Heartbeat(get_bus(), 0.5, {"worker_id": worker_id, "queue": "q-" + worker_id}, Incarnation())
heartbeat.start()
print(heartbeat.process.pid, flush=True)
sys.stdin.readline()
started = time.monotonic()
ctypes.PyDLL(None).sleep(hold_s)
print(f"held {time.monotonic() - started:.1f}", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def daemon(clean_db: None) -> SchedulerDaemon:
    bus = get_bus()
    settings = get_settings().model_copy(update={"worker_timeout_s": TIMEOUT_S})
    d = SchedulerDaemon(settings, bus, get_celery(), consumer="test")
    while batch := bus.consume(SCHEDULER_STREAM, "scheduler", "test", count=1000, block_s=0.01):
        bus.ack(SCHEDULER_STREAM, "scheduler", [i for i, _ in batch])
    return d


@pytest.fixture
def worker_process() -> Iterator[tuple[str, subprocess.Popen[str], int]]:
    """(worker id, the worker process, its heartbeat process's pid)."""
    worker_id = f"hb-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, worker_id, str(int(3 * TIMEOUT_S))], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    beater = int(proc.stdout.readline())
    try:
        yield worker_id, proc, beater
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Every core busy, at the worker's priority."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def worker_state(worker_id: str) -> str | None:
    with session_scope() as s:
        worker = s.get(Worker, worker_id)
        return None if worker is None else worker.state


def step_until(daemon: SchedulerDaemon, worker_id: str, state: str) -> None:
    deadline = time.monotonic() + START_CEILING_S
    while worker_state(worker_id) != state:
        assert time.monotonic() < deadline, f"worker {worker_id} never became {state}"
        daemon.step(block_s=0.2)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_worker_holding_its_gil_with_every_core_busy_keeps_its_heartbeat(
        daemon: SchedulerDaemon, worker_process: tuple[str, subprocess.Popen[str], int], busy_cores: None) -> None:
    worker_id, proc, _ = worker_process
    assert proc.stdin is not None and proc.stdout is not None
    step_until(daemon, worker_id, states.WORKER_ALIVE)
    proc.stdin.write("hold\n")
    proc.stdin.flush()
    # The daemon reaps with a 4 s timeout on every round while the worker holds its GIL for three timeouts.
    os.set_blocking(proc.stdout.fileno(), False)
    rounds, deadline = 0, time.monotonic() + START_CEILING_S
    while not (line := proc.stdout.readline()):
        assert time.monotonic() < deadline, "the worker never let go of its GIL"
        daemon.step(block_s=0.2)
        rounds += 1
        assert worker_state(worker_id) == states.WORKER_ALIVE, f"declared lost after {rounds} rounds"
    held_s = float(line.split()[1])
    assert held_s >= 3 * TIMEOUT_S - 0.5  # it did hold it that long (no thread of it could have beaten meanwhile)
    daemon.step(block_s=0.2)
    assert worker_state(worker_id) == states.WORKER_ALIVE


def test_the_heartbeat_process_ends_with_its_killed_worker(
        daemon: SchedulerDaemon, worker_process: tuple[str, subprocess.Popen[str], int]) -> None:
    worker_id, proc, beater = worker_process
    step_until(daemon, worker_id, states.WORKER_ALIVE)
    assert running(beater)
    os.kill(proc.pid, signal.SIGKILL)  # the worker alone, as the OOM killer would: not its process group
    proc.wait()
    deadline = time.monotonic() + START_CEILING_S
    while running(beater):
        assert time.monotonic() < deadline, "the heartbeat process outlived its worker"
        time.sleep(0.05)
    step_until(daemon, worker_id, states.WORKER_LOST)  # no beat comes any more: past the timeout it is lost


def test_a_beat_says_when_each_pack_last_progressed() -> None:
    state, clock = BeatState(), ProgressClock()
    assert state.read() == ([], None, None)
    one = state.add_pack("pack-1")
    state.set_warm([{"name": "m", "revision": "r", "bytes": 1, "last_used_at": 2.0}])
    state.set_free_memory(123)
    packs, warm, free = state.read()
    assert packs == [("pack-1", 0)] and free == 123
    assert warm == [{"name": "m", "revision": "r", "bytes": 1, "last_used_at": 2.0}]
    assert clock.observe(packs, 10.0) == {"pack-1": 10.0}
    assert clock.observe(state.read()[0], 20.0) == {"pack-1": 10.0}  # no step, no phase since: it has not progressed
    state.progressed(one)
    assert clock.observe(state.read()[0], 30.0) == {"pack-1": 30.0}
    # A second pack beside it (a worker running several, worker/colocation.py): each has its own count and clock.
    two = state.add_pack("pack-2")
    assert clock.observe(state.read()[0], 40.0) == {"pack-1": 30.0, "pack-2": 40.0}
    state.progressed(two)
    state.progressed(two)
    assert state.read()[0] == [("pack-1", 1), ("pack-2", 2)]
    assert clock.observe(state.read()[0], 50.0) == {"pack-1": 30.0, "pack-2": 50.0}
    state.remove_pack(one)
    assert clock.observe(state.read()[0], 60.0) == {"pack-2": 50.0}
    three = state.add_pack("pack-3")  # takes the freed slot, its count from 0 again
    assert three == one and state.read()[0] == [("pack-3", 0), ("pack-2", 2)]
    state.remove_pack(two)
    state.remove_pack(three)
    assert clock.observe(state.read()[0], 70.0) == {}
    for i in range(BeatState.MAX_PACKS):
        state.add_pack(f"p{i}")
    with pytest.raises(RuntimeError, match="already runs"):
        state.add_pack("one-too-many")
