"""What a 4-bit base (issue 36, worker/engine/quantize.py) costs and buys a pack: the same pack of trials on a base
held in bf16 and in NF4, side by side in one run (tokens/s of the pack's training steps and the GPU's peak memory),
and a shape one GPU cannot hold in bf16 (Llama-3.1-70B) training on it in NF4. Random weights in real architectures'
shapes, each weight drawn on the GPU (and quantised as it is drawn: `benchmarks.base_models.build`).

    python -m benchmarks.qlora --shape llama-3.1-8b --trials 8 --steps 30          # bf16 against nf4, on a GPU
    python -m benchmarks.qlora --shape llama-3.1-70b --modes nf4 --trials 2 --batch-size 2
    python -m benchmarks.qlora --shape tiny --trials 2 --steps 4                    # anywhere (smoke run)
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.base_models import SHAPES, build, make_rows, tiny_tokenizer
from benchmarks.common import write_result
from benchmarks.engine_pack import spec, sync
from worker.engine import PackCallbacks, PackConfig, train_pack
from worker.engine.quantize import tensor_bytes
from worker.engine.trainer import PackTimings


def run(shape: str, mode: str, device: torch.device, args: argparse.Namespace, tokenizer: object,
        out: Path) -> list[object]:
    """One pack on the base held in `mode` ("bf16": the full base, fp32 on a CPU; or "nf4"): its row of the table."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = build(shape, device, layers=args.layers, quantization=None if mode == "bf16" else mode)
    sync()
    build_s = time.perf_counter() - started
    base_gib = tensor_bytes(model) / 2**30
    rows = make_rows(256, args.seq_len, seed=0, min_fraction=1.0)
    trials = [spec(i, args.steps, args.seq_len, args.batch_size, rows) for i in range(args.trials)]
    timings = PackTimings()
    sync()
    started = time.perf_counter()
    train_pack(model, tokenizer, trials, PackConfig(base_model_name=shape, export_dir=out / mode),  # type: ignore[arg-type]
               PackCallbacks(on_point=lambda *a: None), timings=timings)
    sync()
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    steps_s = timings.summary().get("steps_s") or wall
    tokens = args.trials * args.steps * args.batch_size * args.seq_len
    del model
    gc.collect()
    print(mode, round(wall, 2), timings.summary(), flush=True)
    label = mode if mode != "bf16" or device.type == "cuda" else "fp32"  # the full base: bf16 on CUDA only
    return [label, round(build_s, 1), round(base_gib, 2), round(peak, 2), round(float(steps_s), 2),
            round(tokens / float(steps_s)), round(wall, 2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, help="keep the first L decoder layers (default: all)")
    parser.add_argument("--modes", nargs="+", choices=["bf16", "nf4"], default=["bf16", "nf4"])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tiny_tokenizer(Path(tmp))
        # Warm-up on two layers of the shape in every mode (CUDA context, kernels, torchao's import), so that the
        # first row is not charged for it.
        warm = argparse.Namespace(**{**vars(args), "layers": 2, "trials": 1, "steps": 3})
        for mode in args.modes:
            run(args.shape, mode, device, warm, tokenizer, Path(tmp) / "warm")
        table = [run(args.shape, mode, device, args, tokenizer, Path(tmp)) for mode in args.modes]
    write_result(
        f"qlora-{args.shape}" + (f"-{args.layers}layers" if args.layers else ""),
        ["base", "build s", "base GiB", "peak GiB", "steps s", "tokens/s (steps)", "pack s"],
        table,
        {"shape": args.shape, "layers": args.layers, "trials": args.trials, "steps": args.steps,
         "seq_len": args.seq_len, "batch_size": args.batch_size,
         "lora": "rank 16, alpha 32, dropout 0.05, all 7 projections",
         "what": "one pack on the base in bf16 and in NF4 (torchao NF4Tensor, blocks of 64; the LoRA delta on the "
                 "torch path, the Triton kernel reads plain weights only), in this order, in one process"},
    )


if __name__ == "__main__":
    main()
