"""A pack over the GPUs of one host (issue 20): tokens/s of one pack sharded over N ranks against the same pack on one
GPU, and whether they train the same adapters.

    torchrun --nproc_per_node=N -m benchmarks.multi_gpu --shape llama-3.1-8b --trials 16 [--layers L] [--no-single]

Every rank builds the same random-weight model of `--shape` on its GPU, never on disk (`base_models.build`: each
weight drawn from a seed of its name; sharded, each rank keeps its shard of each).
First, unless `--no-single`, rank 0 trains every trial alone on its GPU, as one pack (the baseline), while the
others wait. Then every rank shards the base's layers over the N GPUs (`worker.engine.distributed.shard_base`) and
trains its share of the trials (`assign_ranks`) in lockstep: the pack over N GPUs. Each measures `--steps` steps
after `--warmup`, tokens counted as the rows' real tokens (no padding). Each trial's mean loss over the measured
steps is compared with the baseline's (bf16: not bit-exact; the largest relative difference is shown; the CPU test,
tests/engine/test_distributed.py, shows the adapters equal in fp32). Each configuration runs twice and the second
is measured. `--layers` cuts the model to its first L layers (a 70B shape that one GPU cannot hold is
shown with as many layers as make the point). With N = 1 the sharded run measures what the sharding machinery
costs on one GPU. Results: benchmarks/results/multi_gpu-<shape>-<N>gpu-<device>-<date>.json (rank 0 writes).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.base_models import SHAPES, build, make_rows, projections, tiny_tokenizer
from benchmarks.common import write_result
from worker.engine import PackEngine, TrialSpec
from worker.engine.distributed import Lockstep, assign_ranks

RANKS = (16, 32, 64)


def trial_specs(k: int, batch: int, seq_len: int, rows: list[dict[str, str]], targets: list[str]) -> list[TrialSpec]:
    return [TrialSpec(trial_id=f"t{i:02d}", learning_rate=1e-4 * (1 + i % 4), lora_rank=RANKS[i % len(RANKS)],
                      lora_alpha=2.0 * RANKS[i % len(RANKS)], lora_dropout=0.0, batch_size=batch,
                      target_modules=targets, seed=i, max_steps=10**6, max_seq_len=seq_len, eval_interval=10**9,
                      train_rows=rows, val_rows=[]) for i in range(k)]


def train(model: Any, tokenizer: Any, specs: list[TrialSpec], device: torch.device, warmup: int, steps: int,
          lockstep: Lockstep | None, profiled: dict[str, Any] | None = None, trace: Path | None = None,
          ) -> tuple[float, int, dict[str, float], int]:
    """(seconds of the measured steps, their real tokens, each trial's mean loss over them, peak bytes). With
    ``profiled`` (a dict), two more steps run under torch.profiler and their time split goes into it
    (``step_profile``)."""
    engine = PackEngine(model, tokenizer, capacity=max(1, len(specs)), device=device, max_rank=max(RANKS),
                        target_modules=specs[0].target_modules if specs else None, lockstep=lockstep)
    with engine:
        for spec in specs:
            engine.admit(spec)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tokens, losses = 0, {spec.trial_id: 0.0 for spec in specs}
        for i in range(warmup + steps):
            if i == warmup:
                wait(device, lockstep)
                started, tokens = time.perf_counter(), 0
            step_losses = engine.step()
            if i >= warmup:
                tokens += engine.last_stats.tokens if engine.last_stats is not None else 0
                for trial_id, loss in step_losses.items():
                    losses[trial_id] += loss / steps
        wait(device, lockstep)
        seconds = time.perf_counter() - started
        if profiled is not None:
            profiled.update(step_profile(engine, device, lockstep, 2, trace))
    return seconds, tokens, losses, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


KERNEL_KINDS = (("nccl", ("nccl",)), ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "matmul", "grouped_mm")),
                ("triton", ("triton",)))


def step_profile(engine: PackEngine, device: torch.device, lockstep: Lockstep | None, steps: int,
                 trace: Path | None = None) -> dict[str, Any]:
    """Where ``steps`` more steps' wall time goes on this rank: the GPU's kernel time by kind (NCCL collectives,
    GEMMs, Triton kernels, the rest), the time some compute kernel ran (``compute_busy_s``), the NCCL time no
    compute kernel hid (``nccl_exposed_s``) and the time no kernel ran at all (host work, waits on the other rank).
    What the issue-37 question (why two GPUs are not twice one) needs. With ``trace``, the profiler's Chrome trace
    is written there (gzip) and its operator tables beside it. This loop calls ``engine.step`` alone, so the
    lockstep's host agreements (the trainer's loop, worker/engine/trainer.py) are not in it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    wait(device, lockstep)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        wait(device, lockstep)
    wall = time.perf_counter() - started
    kinds = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    compute: list[tuple[float, float]] = []
    nccl: list[tuple[float, float]] = []
    for event in prof.events():
        if str(event.device_type).split(".")[-1] != "CUDA":
            continue
        name = event.name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in name for key in keys)), "other")
        span = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        kinds[kind] += span[1] - span[0]
        (nccl if kind == "nccl" else compute).append(span)
    busy = sum(stop - start for start, stop in union(compute + nccl))
    compute_busy = sum(stop - start for start, stop in union(compute))
    exposed = busy - compute_busy  # NCCL time during which no compute kernel ran
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as source, gzip.open(trace, "wb") as target:
            shutil.copyfileobj(source, target)
        raw.unlink()
        tables = [prof.key_averages().table(sort_by=key, row_limit=25)
                  for key in ("self_cpu_time_total", "self_device_time_total")]
        trace.with_name(trace.name.replace(".json.gz", ".txt")).write_text("\n\n".join(tables))
    return {"steps": steps, "wall_s": round(wall, 4), "kernel_s": {k: round(v, 4) for k, v in kinds.items()},
            "gpu_busy_s": round(busy, 4), "compute_busy_s": round(compute_busy, 4),
            "nccl_exposed_s": round(exposed, 4), "no_kernel_s": round(max(0.0, wall - busy), 4)}


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The spans merged where they overlap: the time any of them ran."""
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def trace_path(directory: Path | None, label: str) -> Path | None:
    return directory / f"multi_gpu-trace-{label}.json.gz" if directory is not None else None


def wait(device: torch.device, lockstep: Lockstep | None) -> None:
    """Until this rank's queued work is done and, in the sharded run, every rank's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if lockstep is not None:
        dist.barrier()


def largest_rel_diff(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest relative difference of a trial's mean loss between two runs (bf16: the same math in another
    order differs a little; adapters are no measure here, AdamW's first steps turn noise-sized gradients into
    full-sized updates of either sign)."""
    return max((abs(a[t] - b[t]) / abs(b[t]) for t in a), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first L decoder layers")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layout", choices=("shard", "shard-keep", "replicate"), default="shard",
                        help="the base over the ranks: sharded (each layer gathered per pass), sharded but kept "
                             "whole from forward to backward, or whole on every rank (no collective in a pass)")
    parser.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline (it does not fit)")
    parser.add_argument("--profile", action="store_true",
                        help="after the measured steps, two more under torch.profiler: each rank's time split")
    parser.add_argument("--trace", type=Path, default=None,
                        help="with --profile: write each profile's Chrome trace (gzip) and operator tables here")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("LORAPLANE_BENCH_DIR", tempfile.gettempdir())))
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")  # a CPU smoke run of the script
    rank, world = dist.get_rank(), dist.get_world_size()
    directory = args.dir / "multi_gpu-tokenizer"
    if rank == 0:
        tiny_tokenizer(directory)
    dist.barrier()
    tokenizer = tiny_tokenizer(directory)
    rows = make_rows(64, args.seq_len, seed=0)
    specs = trial_specs(args.trials, args.batch, args.seq_len, rows, projections(args.shape))
    mine = assign_ranks(specs, world)[rank]

    # Each configuration twice, the second measured: the first tunes the kernels (Triton autotunes per shape) for
    # both, so neither profits from the other's warm caches.
    for _ in range(2):
        single: tuple[float, int, dict[str, float], int] | None = None
        single_profile: dict[str, Any] | None = {} if args.profile else None
        sharded_profile: dict[str, Any] | None = {} if args.profile else None
        if not args.no_single and rank == 0:
            single = train(build(args.shape, device, layers=args.layers), tokenizer, specs, device, args.warmup,
                           args.steps, None, single_profile, trace_path(args.trace, "one_gpu"))
            if cuda:
                torch.cuda.empty_cache()
        dist.barrier()
        # Built sharded in place (shard_base on the meta model): no GPU ever holds the whole model. Or, for the
        # comparison, every rank holds it whole and the passes make no collective (`replicate`).
        model = build(args.shape, device, layers=args.layers, shard=args.layout != "replicate",
                      reshard_after_forward=args.layout == "shard")
        seconds, tokens, adapters, peak = train(model, tokenizer, mine, device, args.warmup, args.steps, Lockstep(),
                                                sharded_profile, trace_path(args.trace, f"rank{rank}"))
        del model
        if cuda:
            torch.cuda.empty_cache()
    totals = torch.tensor([tokens], dtype=torch.int64, device=device)
    dist.all_reduce(totals)  # every rank's real tokens: the pack's
    diff = largest_rel_diff(adapters, single[2]) if single is not None else None
    diffs = [None] * world
    dist.all_gather_object(diffs, diff)
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, peak)
    profiles: list[Any] = [None] * world
    dist.all_gather_object(profiles, sharded_profile)
    if rank == 0:
        report(args, world, single, seconds, int(totals.item()), peaks, diffs,
               {"one_gpu": single_profile, "ranks": profiles} if args.profile else None)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def report(args: argparse.Namespace, world: int, single: tuple[float, int, dict[str, float], int] | None,
           seconds: float, tokens: int, peaks: list[Any], diffs: list[Any], profiles: dict[str, Any] | None) -> None:
    sharded_tps = tokens / seconds
    rows: list[list[Any]] = []
    if single is not None:
        rows.append(["one GPU, one pack", 1, round(single[1] / single[0]), 1.0, round(single[3] / 2**30, 1), ""])
    ratio = round(sharded_tps / (single[1] / single[0]), 2) if single is not None else ""
    worst = max((d for d in diffs if d is not None), default=None)
    layout = {"shard": "base sharded", "shard-keep": "base sharded, kept to backward", "replicate": "base whole"}
    rows.append([f"{world} GPUs, {layout[args.layout]}, trials dealt", world, round(sharded_tps), ratio,
                 round(max(peaks) / 2**30, 1), "" if worst is None else f"{worst:.1e}"])
    layers = f"-{args.layers}layers" if args.layers is not None else ""
    layers += f"-{args.layout}" if args.layout != "shard" else ""
    headers = ["run", "gpus", "tokens/s", "x one GPU", "peak GiB per GPU", "loss rel diff"]
    write_result(f"multi_gpu-{args.shape}{layers}-{world}gpu", headers, rows,
                 {"shape": args.shape, "layers": args.layers, "layout": args.layout, "trials": args.trials,
                  "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
                  "step_profiles": profiles})
    if profiles is not None:
        for label, profile in [("one GPU", profiles["one_gpu"])] + [(f"rank {r}", p)
                                                                  for r, p in enumerate(profiles["ranks"])]:
            print(f"{label}: {profile}")


if __name__ == "__main__":
    main()
