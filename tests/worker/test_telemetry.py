"""The worker's metrics of where its packs' wall time went (worker/telemetry.py): a real pack of the tiny model on
the CPU, its phase counters and outside-steps gauge read through the worker's own metrics endpoint against the
`pack.profile` it reported; and profiles of older workers (first names, missing phases)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from common.bus import SCHEDULER_STREAM
from common.settings import Settings
from tests.e2e.procs import free_port
from tests.prom import Key, samples, value
from tests.worker.test_runner import model_cache, pack, runner  # noqa: F401  (fixtures)
from worker import telemetry
from worker.pack_runner import PackRunner

COUNTER = "loraplane_worker_pack_phase_seconds_total"
GAUGE = "loraplane_worker_last_pack_outside_steps_ratio"
# Three phases' names before issue 30, which a profile may still carry.
FIRST_NAMES = {"checkpoints_s": "snapshot_s", "exports_s": "export_s", "waiting_s": "idle_s"}
PHASES = ("load", "capture", "steps", "validation", "metric", "snapshot", "persist", "export", "idle", "other")


@pytest.fixture
def metrics_url() -> Iterator[str]:
    port = free_port()
    settings = Settings().model_copy(update={"worker_metrics_port": port, "metrics_host": "127.0.0.1"})
    server = telemetry.start(settings, torch.device("cpu"))
    assert server is not None
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.close()


def scrape(url: str) -> dict[Key, float]:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    return samples(r.text)


def counted(before: dict[Key, float], after: dict[Key, float]) -> dict[str, float]:
    """Seconds each phase's counter went up by between two scrapes (the registry lives as long as the process)."""
    return {p: round(value(after, COUNTER, phase=p) - value(before, COUNTER, phase=p), 6) for p in PHASES}


def test_a_packs_phases_are_counted_at_its_end(runner: PackRunner, metrics_url: str) -> None:  # noqa: F811
    before = scrape(metrics_url)
    runner.run(pack("pack-metrics"))
    after = scrape(metrics_url)
    [profile] = [m["profile"] for _, m in runner.bus.consume(SCHEDULER_STREAM, "test", "c", count=10_000, block_s=0)
                 if m["type"] == "pack.profile"]
    phases: dict[str, Any] = profile["phases"]
    delta = counted(before, after)
    assert delta["steps"] == pytest.approx(phases["steps_s"], abs=1e-6) and delta["steps"] > 0
    for name, seconds in phases.items():  # every phase it measured, counted once, as it reported it
        if name.endswith("_s") and name != "wall_s":
            phase = FIRST_NAMES.get(name, name).removesuffix("_s")
            assert delta[phase] == pytest.approx(seconds, abs=1e-6), name
    # Every phase but persist (the writer thread's) adds up to the pack's wall time; `other` is the rest.
    wall_phases = sum(v for p, v in delta.items() if p != "persist")
    assert wall_phases == pytest.approx(phases["wall_s"], abs=0.01)
    assert value(after, GAUGE) == phases["outside_steps_frac"] and 0 < phases["outside_steps_frac"] < 1


def test_older_profiles_count_under_the_new_names_and_missing_phases_count_nothing(metrics_url: str) -> None:
    before = scrape(metrics_url)
    # A worker before issue 30: no load, capture or persist; snapshots, exports and the end's wait by first names.
    telemetry.pack_profiled({"wall_s": 10.0, "steps_s": 4.0, "validation_s": 1.5, "metric_s": 0.0,
                             "checkpoints_s": 0.5, "exports_s": 0.25, "waiting_s": 2.0, "outside_steps_frac": 0.6})
    after = scrape(metrics_url)
    assert counted(before, after) == {"load": 0, "capture": 0, "steps": 4.0, "validation": 1.5, "metric": 0,
                                      "snapshot": 0.5, "persist": 0, "export": 0.25, "idle": 2.0, "other": 1.75}
    assert value(after, GAUGE) == 0.6
    telemetry.pack_profiled({"steps_s": "fast", "outside_steps_frac": None})  # malformed: nothing counted or set
    assert counted(after, scrape(metrics_url)) == dict.fromkeys(PHASES, 0)
    assert value(scrape(metrics_url), GAUGE) == 0.6
