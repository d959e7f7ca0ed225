"""Where a training step's time goes: device time per kernel family, and how much of the wall time the
device was busy at all (the rest is the host launching work, or waiting).

Used by ``benchmarks.engine_throughput --profile`` for the engine and the frozen ceiling side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

# (family, substrings of a kernel name), first match wins. Names seen on an H100 (torch 2.11, CUDA 13):
# cuBLAS kernels are "nvjet_*" / "sm90_xmma_*" / "*gemm*"; inductor's are "triton_poi_* / triton_red_*".
FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    ("lora: base GEMM + expand (triton)", ("_linear_kernel",)),
    ("lora: shrink / dS (triton)", ("_shrink_kernel",)),
    ("lora: shrink + expand term (triton)", ("_lora_term_kernel",)),
    ("lora: dA / dB (triton)", ("_outer_kernel",)),
    ("optimizer (AdamW)", ("_slot_adamw", "triton_poi", "triton_red", "triton_per", "_adamw")),
    ("GEMM (cuBLAS)", ("nvjet", "xmma", "gemm", "cutlass", "splitkreduce", "sm90_")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("copies / fills", ("memcpy", "memset", "copy_", "fill")),
    ("reductions (loss, norms)", ("reduce", "softmax", "cross_entropy", "nll", "norm")),
    ("elementwise (torch)", ("elementwise", "vectorized", "unrolled", "index", "scatter", "gather", "cat")),
]


def family(name: str) -> str:
    lowered = name.lower()
    for label, keys in FAMILIES:
        if any(k.lower() in lowered for k in keys):
            return label
    return "other"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def breakdown(step: Callable[[], Any], steps: int = 3) -> dict[str, Any]:
    """Profile ``steps`` calls of ``step`` (already warm) and return per-step device milliseconds by kernel
    family, the device-busy and wall milliseconds per step, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    if not torch.cuda.is_available():  # a CPU smoke run: no device kernels to attribute
        return {"wall_ms_per_step": round(wall_ms, 2), "device_busy_ms_per_step": 0.0,
                "families_ms_per_step": {}, "top_kernels_ms_per_step": {}}

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    by_family: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = float(event.device_time)
        by_family[family(event.name)] = by_family.get(family(event.name), 0.0) + us
        by_kernel[event.name] = by_kernel.get(event.name, 0.0) + us
    busy_ms = sum(by_family.values()) / 1e3 / steps
    families = sorted(((k, v / 1e3 / steps) for k, v in by_family.items()), key=lambda kv: -kv[1])
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {
        "wall_ms_per_step": round(wall_ms, 2),
        "device_busy_ms_per_step": round(busy_ms, 2),
        "families_ms_per_step": {k: round(v, 2) for k, v in families},
        "top_kernels_ms_per_step": {k[:90]: round(v / 1e3 / steps, 3) for k, v in top},
    }


def side_by_side(named: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """A table of milliseconds per step by family, one column per profiled method."""
    names = list(named)
    labels: list[str] = []
    for result in named.values():
        labels += [k for k in result["families_ms_per_step"] if k not in labels]
    rows: list[list[Any]] = [[label, *[named[n]["families_ms_per_step"].get(label, 0.0) for n in names]]
                             for label in labels]
    rows.append(["device busy", *[named[n]["device_busy_ms_per_step"] for n in names]])
    rows.append(["wall (synchronised)", *[named[n]["wall_ms_per_step"] for n in names]])
    return ["ms per step", *names], rows
