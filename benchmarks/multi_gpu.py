"""A pack over the GPUs of one host (issue 20): tokens/s of one pack sharded over N ranks against the same pack on one
GPU, and whether they train the same adapters.

    torchrun --nproc_per_node=N -m benchmarks.multi_gpu --shape llama-3.1-8b --trials 16 [--layers L] [--no-single]

Every rank builds the same random-weight model of `--shape` (rank 0 writes it, the others wait and load it).
First, unless `--no-single`, rank 0 trains every trial alone on its GPU, as one pack (the baseline), while the
others wait. Then every rank shards the base's layers over the N GPUs (`worker.engine.distributed.shard_base`) and
trains its share of the trials (`assign_ranks`) in lockstep: the pack over N GPUs. Each measures `--steps` steps
after `--warmup`, tokens counted as the rows' real tokens (no padding). After the same number of steps, rank r's
adapters are compared with the baseline's of the same trials (bf16: not bit-exact, the largest relative
difference is shown). `--layers` cuts the model to its first L layers (a 70B shape that one GPU cannot hold is
shown with as many layers as make the point). With N = 1 the sharded run measures what the sharding machinery
costs on one GPU. Results: benchmarks/results/multi_gpu-<shape>-<N>gpu-<device>-<date>.json (rank 0 writes).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import write_result
from benchmarks.models import SHAPES, load, make_rows, materialise, projections
from worker.engine import PackEngine, TrialSpec
from worker.engine.distributed import Lockstep, assign_ranks, shard_base

RANKS = (16, 32, 64)


def trial_specs(k: int, batch: int, seq_len: int, rows: list[dict[str, str]], targets: list[str]) -> list[TrialSpec]:
    return [TrialSpec(trial_id=f"t{i:02d}", learning_rate=1e-4 * (1 + i % 4), lora_rank=RANKS[i % len(RANKS)],
                      lora_alpha=2.0 * RANKS[i % len(RANKS)], lora_dropout=0.0, batch_size=batch,
                      target_modules=targets, seed=i, max_steps=10**6, max_seq_len=seq_len, eval_interval=10**9,
                      train_rows=rows, val_rows=[]) for i in range(k)]


def train(model: Any, tokenizer: Any, specs: list[TrialSpec], device: torch.device, warmup: int, steps: int,
          lockstep: Lockstep | None) -> tuple[float, int, dict[str, Any], int]:
    """(seconds of the measured steps, their real tokens, each trial's adapter after warmup + steps, peak bytes)."""
    engine = PackEngine(model, tokenizer, capacity=max(1, len(specs)), device=device, max_rank=max(RANKS),
                        target_modules=specs[0].target_modules if specs else None, lockstep=lockstep)
    with engine:
        for spec in specs:
            engine.admit(spec)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tokens = 0
        for i in range(warmup + steps):
            if i == warmup:
                wait(device, lockstep)
                started, tokens = time.perf_counter(), 0
            engine.step()
            tokens += engine.last_stats.tokens if engine.last_stats is not None else 0
        wait(device, lockstep)
        seconds = time.perf_counter() - started
        adapters: dict[str, Any] = {
            engine.state(s).spec.trial_id: {k: [x.float().cpu() for x in v] for k, v in engine.adapter(s).items()}
            for s in range(len(specs))
        }
    return seconds, tokens, adapters, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def wait(device: torch.device, lockstep: Lockstep | None) -> None:
    """Until this rank's queued work is done and, in the sharded run, every rank's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if lockstep is not None:
        dist.barrier()


def largest_rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for trial_id, modules in a.items():
        for key, tensors in modules.items():
            for x, y in zip(tensors, b[trial_id][key], strict=True):
                worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first L decoder layers")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline (it does not fit)")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("LORAPLANE_BENCH_DIR", tempfile.gettempdir())))
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo: a CPU smoke run of the script
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    directory = args.dir / f"multi_gpu-{args.shape}-{args.layers}"
    if rank == 0:
        materialise_shape(args.shape, args.layers, directory)
    dist.barrier()
    tokenizer = load_tokenizer(directory)
    rows = make_rows(64, args.seq_len, seed=0)
    specs = trial_specs(args.trials, args.batch, args.seq_len, rows, projections(args.shape))
    mine = assign_ranks(specs, world)[rank]

    single: tuple[float, int, dict[str, Any], int] | None = None
    if not args.no_single and rank == 0:
        single = train(load(directory / "base", device), tokenizer, specs, device, args.warmup, args.steps, None)
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    model = load(directory / "base", device)
    shard_base(model)
    seconds, tokens, adapters, peak = train(model, tokenizer, mine, device, args.warmup, args.steps, Lockstep())
    totals = torch.tensor([tokens], dtype=torch.int64, device=device)
    dist.all_reduce(totals)  # every rank's real tokens: the pack's
    diff = largest_rel_diff(adapters, single[2]) if single is not None else None
    diffs = [None] * world
    dist.all_gather_object(diffs, diff)
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        report(args, world, single, seconds, int(totals.item()), peaks, diffs)
    dist.destroy_process_group()


def materialise_shape(shape: str, layers: int | None, directory: Path) -> None:
    if layers is not None:
        SHAPES[shape] = {**SHAPES[shape], "num_hidden_layers": layers}
    tokenizer, _ = materialise(shape, directory)
    tokenizer.save_pretrained(directory / "tokenizer")


def load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory / "tokenizer")


def report(args: argparse.Namespace, world: int, single: tuple[float, int, dict[str, Any], int] | None,
           seconds: float, tokens: int, peaks: list[Any], diffs: list[Any]) -> None:
    sharded_tps = tokens / seconds
    rows: list[list[Any]] = []
    if single is not None:
        rows.append(["one GPU, one pack", 1, round(single[1] / single[0]), 1.0, round(single[3] / 2**30, 1), ""])
    ratio = round(sharded_tps / (single[1] / single[0]), 2) if single is not None else ""
    worst = max((d for d in diffs if d is not None), default=None)
    rows.append([f"{world} GPUs, base sharded, trials dealt", world, round(sharded_tps), ratio,
                 round(max(peaks) / 2**30, 1), "" if worst is None else f"{worst:.1e}"])
    layers = f"-{args.layers}layers" if args.layers is not None else ""
    headers = ["run", "gpus", "tokens/s", "x one GPU", "peak GiB per GPU", "adapter rel diff"]
    write_result(f"multi_gpu-{args.shape}{layers}-{world}gpu", headers, rows,
                 {"shape": args.shape, "layers": args.layers, "trials": args.trials, "batch": args.batch,
                  "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup})


if __name__ == "__main__":
    main()
