"""The worker's sampler (worker/sampler.py): its process started only once sampling was asked of one of the worker's
models; a batch's KV cache kept within its budget, the rest left to the next batch; what it holds told to the worker
(and on in its heartbeat) after each batch and unload. Its answers through a real `loraplane up`:
tests/e2e/test_trained_adapters.py."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from common.artifacts import LocalArtifactStore
from common.bus import SCHEDULER_STREAM, FileBus, sampling_reply_stream, sampling_stream
from common.messages import ModelSourceFields, SampleRequest, WorkerHeartbeat
from tests.conftest import MODEL_CACHE
from worker.heartbeat import Heartbeat, Incarnation
from worker.sampler import Sampler, SamplerConfig, SamplerProcess, batch_fits, sampling_used


def test_a_worker_starts_its_sampler_once_sampling_was_asked_of_one_of_its_models(tmp_path: Path) -> None:
    bus = FileBus(tmp_path / "bus.sqlite")
    assert not sampling_used(bus, ["tiny-random-llama", "other"])
    bus.publish(sampling_stream("other-model"), {"type": "sample"})
    assert not sampling_used(bus, ["tiny-random-llama", "other"])  # a model this worker does not load
    bus.publish(sampling_stream("other"), {"type": "sample"})
    assert sampling_used(bus, ["tiny-random-llama", "other"])


def test_a_batch_keeps_its_kv_cache_within_the_budget_and_always_takes_the_first() -> None:
    # rows x (longest prompt + most new tokens): 2 x (100 + 50) = 300 fits 300; a third row makes 3 x 150 = 450
    assert batch_fits([(100, 50), (20, 10), (10, 10)], 300) == 2
    assert batch_fits([(100, 50), (20, 10), (10, 10)], 450) == 3
    assert batch_fits([(1000, 1000), (1, 1)], 10) == 1  # the first alone, even past the budget
    assert batch_fits([(10, 10), (200, 10)], 300) == 1  # a long second prompt pads every row
    assert batch_fits([], 10) == 0


def test_requests_a_batch_left_over_are_the_next_batch_unless_expired(tmp_path: Path) -> None:
    bus = FileBus(tmp_path / "bus.sqlite")
    sampler = Sampler(SamplerConfig(worker_id="w", device="cpu", make_bus=lambda: bus,
                                    make_store=lambda: LocalArtifactStore(tmp_path / "store"),
                                    model_cache_dir=tmp_path), bus, LocalArtifactStore(tmp_path / "store"))

    def request(request_id: str, deadline: float) -> SampleRequest:
        return SampleRequest(request_id=request_id, tenant_id="t", base_model=ModelSourceFields(name="m", kind="hf"),
                             prompt="x", max_tokens=4, temperature=0.0, top_p=1.0, seed=0, sent_at=0.0,
                             deadline=deadline)

    sampler.held = [request("late", time.time() - 1), request("kept", time.time() + 60)]
    assert [r.request_id for r in sampler.take()] == ["kept"] and sampler.held == []


def test_the_sampler_process_ends_when_its_worker_closes_it_not_killed(tmp_path: Path) -> None:
    """It ignores SIGTERM (as every child of the worker does, so that a terminal's Ctrl-C reaches only the worker):
    `close` asks it to end, and it does, by itself."""
    from worker.main import sampler_main

    process = SamplerProcess(SamplerConfig(worker_id="w", device="cpu", make_bus=partial(FileBus, tmp_path / "bus"),
                                           make_store=partial(LocalArtifactStore, tmp_path / "store"),
                                           model_cache_dir=tmp_path), entry=sampler_main)
    process._spawn()  # as the worker does on the first request
    deadline = time.monotonic() + 120
    while not (tmp_path / "bus").exists() and time.monotonic() < deadline:  # it opened its bus: serving
        time.sleep(0.2)
    process.close(timeout_s=30)
    assert process._process.exitcode == 0


def test_what_the_sampler_holds_is_told_after_each_batch_and_unload_and_beats_carry_it(tmp_path: Path) -> None:
    """On a CPU it holds its model's tensors: said once it answered with the model loaded, 0 once it dropped it; the
    worker's heartbeat says the last figure (`sampler_bytes`), which the planner keeps packs out of
    (tests/scheduler/test_planner_io.py)."""
    bus = FileBus(tmp_path / "bus.sqlite")
    store = LocalArtifactStore(tmp_path / "store")
    said: list[int] = []
    sampler = Sampler(SamplerConfig(worker_id="w", device="cpu", make_bus=lambda: bus, make_store=lambda: store,
                                    model_cache_dir=MODEL_CACHE, idle_s=0.0), bus, store, on_held=said.append)
    request = SampleRequest(request_id="r1", tenant_id="t", base_model=ModelSourceFields(
        name="tiny-random-llama", kind="tiny-random-llama"), prompt="1 plus 2 is", max_tokens=3, temperature=0.0,
        top_p=1.0, seed=0, sent_at=time.time(), deadline=time.time() + 60)
    sampler.answer([request])
    assert bus.read_after(sampling_reply_stream("r1"), "0", 100, 0)  # it answered
    assert sampler.loaded is not None
    model_bytes = sum(t.numel() * t.element_size()
                      for t in (*sampler.loaded.model.parameters(), *sampler.loaded.model.buffers()))
    assert said[-1] == model_bytes > 0  # (a 0 before it: the unload that makes room for a model)

    beats = Heartbeat(bus, 1.0, {"worker_id": "w", "queue": "q", "device": "cpu", "memory_bytes": 10**9},
                      Incarnation())
    beats.sampler_bytes = lambda: said[-1]
    beats.beat()
    sampler.unload_idle()  # idle past `idle_s`: dropped
    assert sampler.loaded is None and said[-1] == 0
    beats.beat()
    sent = [WorkerHeartbeat.model_validate(body) for _, body in bus.read_after(SCHEDULER_STREAM, "0", 100, 0)]
    assert [b.sampler_bytes for b in sent] == [model_bytes, 0]
