"""The worker's sampler process (worker/sampler.py): started only once sampling was asked of one of the worker's
models. Its answers through a real `loraplane up`: tests/e2e/test_trained_adapters.py."""

from __future__ import annotations

from pathlib import Path

from common.bus import FileBus, sampling_stream
from worker.sampler import sampling_used


def test_a_worker_starts_its_sampler_once_sampling_was_asked_of_one_of_its_models(tmp_path: Path) -> None:
    bus = FileBus(tmp_path / "bus.sqlite")
    assert not sampling_used(bus, ["tiny-random-llama", "other"])
    bus.publish(sampling_stream("other-model"), {"type": "sample"})
    assert not sampling_used(bus, ["tiny-random-llama", "other"])  # a model this worker does not load
    bus.publish(sampling_stream("other"), {"type": "sample"})
    assert sampling_used(bus, ["tiny-random-llama", "other"])
