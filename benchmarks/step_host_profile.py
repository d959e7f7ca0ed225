"""Where the host's time goes in one engine step (issue 15: on small shapes the step is host-bound).

Builds the same pack as ``benchmarks.engine_throughput`` (random weights in a real architecture's shape,
ranks 16/32/64 in thirds, all seven projections), warms it up, then profiles a few synchronised steps with
cProfile (Python functions, by own time and by cumulative time) and torch.profiler (operators by host time).

    python -m benchmarks.step_host_profile --shape smollm2-135m --trials 24 --batch 4 --seq-len 96 --backend torch
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.base_models import SHAPES, load, make_rows, materialise, projections
from benchmarks.engine_throughput import engine_steps, sync, trial_specs
from kernels import set_backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_backend(args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, base = materialise(args.shape, Path(tmp))
        rows = make_rows(512, args.seq_len, seed=0)
        model = load(base, device)
        specs = trial_specs(args.trials, args.batch, args.seq_len, rows, 0.0, projections(args.shape))
        step, engine = engine_steps(model, tokenizer, specs, device, recompute=False)
        for _ in range(args.warmup):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        print(f"{args.shape}, {args.trials} trials x batch {args.batch}, backend {args.backend}: "
              f"{(time.perf_counter() - t0) * 1e3 / args.steps:.1f} ms a step (synchronised)")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            step()
        sync()
        profiler.disable()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(35)
            print(f"\n--- cProfile by {key}, {args.steps} steps ---")
            print("\n".join(out.getvalue().splitlines()[6:50]))
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            sync()
        print(f"\n--- torch.profiler, operators by host self time, {args.steps} steps ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        engine.close()


if __name__ == "__main__":
    main()
