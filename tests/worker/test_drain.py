"""SIGTERM drains a worker (worker/drain.py): the drain's order and bound, the signal read off the main thread, and a
real pack of the tiny model on the CPU handing its trials back (the bus is a file). The whole service under SIGTERM:
tests/e2e/test_chaos_distributed.py::test_distributed_worker_sigterm_drains_and_its_trials_resume_elsewhere."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from common.artifacts import LocalArtifactStore
from common.bus import SCHEDULER_STREAM, FileBus
from common.messages import ModelSourceFields, PackMessage, TrialPayload
from worker.drain import GAVE_UP_STATUS, Drain, DrainFlag, listen_for_signals
from worker.heartbeat import BeatState, Heartbeat, Incarnation, ProgressClock, publish_beat
from worker.pack_runner import PackRunner, drain_stops

TINY = ModelSourceFields(name="tiny-random-llama", kind="tiny-random-llama")
WAIT_S = 120.0  # far longer than any wait here takes on two busy cores


def test_a_drain_pauses_every_trial_the_scheduler_did_not_stop_already() -> None:
    assert drain_stops({"b": "drop", "c": "pause"}, ["a", "b", "c"]) == {"a": "pause", "b": "drop", "c": "pause"}
    assert drain_stops({}, []) == {}


class Recorder:
    """What a drain did, in order, and when its exit came (`Drain`'s callables)."""

    def __init__(self, flag: DrainFlag) -> None:
        self.flag = flag
        self.calls: list[str] = []
        self.exited = threading.Event()
        self.status: int | None = None

    def announce(self) -> None:
        self.calls.append(f"announce, flag {self.flag.is_set()}")

    def give_up(self) -> None:
        self.calls.append("give_up")

    def exit(self, status: int) -> None:
        self.status = status
        self.exited.set()


def test_a_drain_announces_then_sets_the_flag_once_and_gives_up_at_its_bound() -> None:
    flag = DrainFlag()
    seen = Recorder(flag)
    drain = Drain(flag, 0.5, announce=seen.announce, give_up=seen.give_up, exit=seen.exit)
    drain.signalled(signal.SIGUSR1)  # not a stop
    assert drain.started_at is None and not flag.is_set()
    started = time.monotonic()
    drain.signalled(signal.SIGTERM)
    drain.signalled(signal.SIGINT)  # a second signal starts nothing more
    assert seen.exited.wait(WAIT_S)
    assert time.monotonic() - started >= 0.5 and seen.status == GAVE_UP_STATUS
    assert seen.calls == ["announce, flag False", "give_up"] and flag.is_set()


def test_a_bus_that_does_not_take_the_announcement_delays_the_pauses_only_briefly() -> None:
    flag, hung = DrainFlag(), threading.Event()
    seen = Recorder(flag)
    def announce() -> None:  # the bus is away: the beat does not go out
        hung.wait(WAIT_S)

    drain = Drain(flag, 30.0, announce=announce, give_up=seen.give_up, exit=seen.exit)
    started = time.monotonic()
    drain.begin("a test")
    while not flag.is_set():
        assert time.monotonic() - started < WAIT_S
        time.sleep(0.05)
    hung.set()
    assert not seen.exited.is_set()


@pytest.fixture
def sigterm_handled() -> Iterator[None]:
    """SIGTERM handled in Python by this process (as Celery's handler does in a worker), restored after, with the
    interpreter's wakeup fd."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        yield
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_is_read_off_the_main_thread(sigterm_handled: None) -> None:
    received: list[int] = []
    heard = threading.Event()

    def on_signal(signum: int) -> None:
        received.append(signum)
        heard.set()

    listen_for_signals(on_signal)
    os.kill(os.getpid(), signal.SIGTERM)
    assert heard.wait(WAIT_S) and received == [signal.SIGTERM]


def test_a_draining_workers_beats_say_so() -> None:
    class Capture:
        def __init__(self) -> None:
            self.published: list[dict[str, Any]] = []

        def publish(self, stream: str, message: dict[str, Any]) -> None:
            self.published.append(message)

    state, bus = BeatState(), Capture()
    for _ in range(2):
        publish_beat(bus, {"worker_id": "w", "queue": "q"}, Incarnation(), state, ProgressClock(), None)  # type: ignore[arg-type]
        state.set_draining()
    assert ["draining" in beat for beat in bus.published] == [False, True]
    assert bus.published[1]["draining"] is True


@pytest.fixture
def model_cache() -> Path:
    from tests.conftest import MODEL_CACHE

    return MODEL_CACHE


def long_pack(pack_id: str, trials: int) -> PackMessage:
    payloads = [TrialPayload(
        trial_id=f"{pack_id}-t{i}", task_id="task", total_steps=100_000, max_seq_len=32, eval_interval=50,
        hyperparameters={"learning_rate": 1e-3, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                         "batch_size": 2, "target_modules": ["q_proj"], "seed": i},
        training_file_key="files/data.jsonl", validation_file_key=None, validation_split=0.25,
        split_seed=0, training={},
    ) for i in range(trials)]
    return PackMessage(pack_id=pack_id, worker_id="w", base_model=TINY, trials=payloads)


def test_a_draining_runner_hands_each_trial_back_from_a_checkpoint_and_refuses_the_next_pack(
        tmp_path: Path, model_cache: Path) -> None:
    bus = FileBus(tmp_path / "bus.db")
    store = LocalArtifactStore(tmp_path / "artifacts")
    rows = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(8)]
    store.put_bytes("files/data.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    flag = DrainFlag()
    runner = PackRunner(worker_id="w", device=torch.device("cpu"), bus=bus, store=store, model_cache_dir=model_cache,
                        heartbeat=Heartbeat(bus, 1.0, {"worker_id": "w", "queue": "q"}, Incarnation()),
                        report_timeout_s=5.0, drain=flag)
    tail = bus.tail_id(SCHEDULER_STREAM)

    def drain_once_both_train() -> None:  # as SIGTERM would, mid-pack
        after, trained = tail, set[str]()
        while len(trained) < 2:
            read = bus.read_after(SCHEDULER_STREAM, after, count=1000, block_s=0.1)
            after = read[-1][0] if read else after
            trained |= {p[0] for _, m in read if m["type"] == "points" for p in m["points"]}
        flag.set()

    threading.Thread(target=drain_once_both_train, daemon=True).start()
    runner.run(long_pack("pack-1", trials=2))  # returns: the pack ended early

    messages = [m for _, m in bus.read_after(SCHEDULER_STREAM, tail, count=100_000, block_s=0)]
    finished = {m["trial_id"]: m for m in messages if m["type"] == "trial.finished"}
    assert {t: (m["status"], m["drained"]) for t, m in finished.items()} == {
        "pack-1-t0": ("paused", True), "pack-1-t1": ("paused", True)}
    for trial_id, end in finished.items():  # each handed back from a checkpoint of the step it paused at
        checkpoint = [m for m in messages if m["type"] == "trial.checkpoint" and m["trial_id"] == trial_id][-1]
        assert checkpoint["step"] == end["steps_done"] > 0 and store.exists(checkpoint["checkpoint_key"])
        assert messages.index(checkpoint) < messages.index(end)
    assert [m["type"] for m in messages if m["type"].startswith("pack.")][-1] == "pack.finished"

    runner.run(long_pack("pack-2", trials=1))  # delivered while the worker drains: nothing of it runs
    later = [m for _, m in bus.read_after(SCHEDULER_STREAM, tail, count=100_000, block_s=0) if m["pack_id"] == "pack-2"]
    assert [(m["type"], m.get("reason")) for m in later] == [("pack.refused", "the worker is shutting down")]
