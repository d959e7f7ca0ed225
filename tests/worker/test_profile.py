import time

from worker.engine import StepStats
from worker.profile import MAX_SAMPLES, PackProfiler


def stats(step: int, tokens: int, padded: int, seconds: float, peak: int | None) -> StepStats:
    return StepStats(step=step, active_slots=2, tokens=tokens, padded_tokens=padded, target_tokens=tokens // 2,
                     seconds=seconds, peak_memory_bytes=peak)


def test_profile_sums_steps_and_keeps_the_first_samples() -> None:
    profiler = PackProfiler(device="cuda:0")
    profiler.record(stats(1, 300, 100, 0.5, 1_000))
    profiler.record(stats(2, 500, 0, 0.5, 3_000))
    summary = profiler.summary()
    assert summary["steps"] == 2 and summary["seconds"] == 1.0
    assert summary["tokens_per_s"] == 800.0
    assert summary["padded_fraction"] == 0.1111  # 100 of 900 computed positions
    assert summary["peak_memory_bytes"] == 3_000
    assert summary["samples"] == [[2, 300, 100, 0.5, 1_000], [2, 500, 0, 0.5, 3_000]]
    for i in range(MAX_SAMPLES + 10):
        profiler.record(stats(3 + i, 10, 0, 0.01, None))
    assert len(profiler.summary()["samples"]) == MAX_SAMPLES and profiler.summary()["steps"] == MAX_SAMPLES + 12


def test_profile_breaks_the_steps_down_into_data_device_wait_and_other_host_work() -> None:
    profiler = PackProfiler(device="cuda:0")
    for data_s in (0.2, 0.0):
        profiler.record(StepStats(step=1, active_slots=2, tokens=10, padded_tokens=0, target_tokens=5, seconds=1.0,
                                  peak_memory_bytes=None, data_s=data_s, prefetch_s=0.1, sync_wait_s=0.3))
    assert profiler.summary()["step_breakdown_s"] == {
        "data": 0.2, "prefetch_overlapped": 0.2, "device_wait": 0.6, "host_other": 1.2,
    }


def test_profile_on_cpu_has_no_memory_and_no_rate_before_a_step() -> None:
    summary = PackProfiler(device="cpu").summary()
    assert summary["peak_memory_bytes"] is None and summary["tokens_per_s"] is None and summary["steps"] == 0


def test_progress_is_reported_every_stretch_of_training_seconds() -> None:
    from worker.engine import StepStats

    profiler = PackProfiler(device="cpu")
    reports = []
    for i in range(7):
        profiler.record(StepStats(step=i + 1, active_slots=2 + i % 2, tokens=90, padded_tokens=10, target_tokens=40,
                                  seconds=4.0, peak_memory_bytes=None))
        reports.append(profiler.take_progress(every_s=10.0))
    # 3 steps of 4 s reach 10 s: one report per 3 steps, of those steps' means; the 7th waits.
    assert [r is not None for r in reports] == [False, False, True, False, False, True, False]
    assert reports[2] == {"steps": 3, "step_s": 4.0, "tokens": 100.0, "slots": 2.333}
    assert reports[5] == {"steps": 3, "step_s": 4.0, "tokens": 100.0, "slots": 2.667}
    assert profiler.steps == 7  # the summary still counts every step


def test_first_step_is_timed_from_the_packs_start_once() -> None:
    profiler = PackProfiler(device="cpu", started=100.0)
    assert profiler.summary()["first_step_s"] is None
    profiler.started = time.perf_counter() - 2.0  # the pack began 2 s ago
    profiler.record(stats(1, 10, 0, 0.1, None))
    first = profiler.summary()["first_step_s"]
    assert 2.0 <= first < 60.0
    profiler.record(stats(2, 10, 0, 0.1, None))
    assert profiler.summary()["first_step_s"] == first  # the later steps change nothing
