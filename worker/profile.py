"""A pack's measured profile: step time and peak memory against batch tokens.

The scheduler stores it on the pack; the planner's cost model fits `M(B) = k0 + k1·B·L` and step time
from many of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from worker.engine import StepStats

MAX_SAMPLES = 200  # every step is summed; the first this many are also kept one by one
PROGRESS_EVERY_S = 10.0  # training seconds between `pack.progress` reports (online step-time correction)


@dataclass
class PackProfiler:
    device: str
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    padded_tokens: int = 0
    peak_memory_bytes: int | None = None
    data_s: float = 0.0  # batch building on the steps' critical path (prefetch misses)
    prefetch_s: float = 0.0  # batch building overlapped with the device
    sync_wait_s: float = 0.0  # the host waiting for the device at each step's sync
    captured_steps: int = 0  # steps replayed from a CUDA graph (worker/engine/capture.py)
    # From the pack's start on this worker (the profiler is made as the pack's message is taken) to its first
    # step's end: model load, set-up and the first step (with its capture), what a user waits for first.
    started: float = field(default_factory=time.perf_counter)
    first_step_s: float | None = None
    samples: list[list[Any]] = field(default_factory=list)  # [active slots, tokens, padded, seconds, peak]
    window: list[StepStats] = field(default_factory=list)  # steps since the last progress report

    def record(self, stats: StepStats) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.started
        self.window.append(stats)
        self.steps += 1
        self.seconds += stats.seconds
        self.tokens += stats.tokens
        self.padded_tokens += stats.padded_tokens
        self.data_s += stats.data_s
        self.prefetch_s += stats.prefetch_s
        self.sync_wait_s += stats.sync_wait_s
        self.captured_steps += stats.captured
        if stats.peak_memory_bytes is not None:
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0, stats.peak_memory_bytes)
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append([stats.active_slots, stats.tokens, stats.padded_tokens, round(stats.seconds, 6),
                                 stats.peak_memory_bytes])

    def take_progress(self, every_s: float = PROGRESS_EVERY_S) -> dict[str, Any] | None:
        """The mean step of the steps since the last report, once they add up to ``every_s`` of training
        (then the window starts over); ``None`` before that."""
        seconds = sum(s.seconds for s in self.window)
        if not self.window or seconds < every_s:
            return None
        n, window, self.window = len(self.window), self.window, []
        return {
            "steps": n,
            "step_s": round(seconds / n, 6),
            "tokens": round(sum(s.tokens + s.padded_tokens for s in window) / n, 1),
            "slots": round(sum(s.active_slots for s in window) / n, 3),
        }

    def summary(self) -> dict[str, Any]:
        total = self.tokens + self.padded_tokens
        return {
            "device": self.device,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "first_step_s": None if self.first_step_s is None else round(self.first_step_s, 3),
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None,
            "padded_fraction": round(self.padded_tokens / total, 4) if total else None,
            "peak_memory_bytes": self.peak_memory_bytes,
            # Where a step's wall time went: waiting for the device (the rest is host work on the critical
            # path, of which `data_s` built batches the prefetch missed).
            "step_breakdown_s": {
                "data": round(self.data_s, 3),
                "prefetch_overlapped": round(self.prefetch_s, 3),
                "device_wait": round(self.sync_wait_s, 3),
                "host_other": round(self.seconds - self.data_s - self.sync_wait_s, 3),
            },
            "captured_steps": self.captured_steps,
            "samples": self.samples,
            "sample_fields": ["active_slots", "tokens", "padded_tokens", "seconds", "peak_memory_bytes"],
        }
