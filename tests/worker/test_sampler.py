"""The worker's sampler (worker/sampler.py): its process started only once sampling was asked of one of the worker's
models; a batch's KV cache kept within its budget, the rest left to the next batch. Its answers through a real
`loraplane up`: tests/e2e/test_trained_adapters.py."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from common.artifacts import LocalArtifactStore
from common.bus import FileBus, sampling_stream
from common.messages import ModelSourceFields, SampleRequest
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
