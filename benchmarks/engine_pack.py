"""Throughput of the training engine on one device: K trials in one pack (base model loaded once) against
the same K trials run one after another, each loading the base model itself (what a one-trial-per-job
service does). Random weights in real architectures' shapes: throughput does not depend on their values.

    python -m benchmarks.engine_pack --shape llama-3.2-1b --trials 1 4 8      # on a GPU
    python -m benchmarks.engine_pack --shape tiny --trials 1 4 --steps 5      # anywhere (smoke run)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.base_models import SHAPES, load, make_rows, materialise
from benchmarks.common import write_result
from worker.engine import PackCallbacks, PackConfig, TrialSpec, train_pack


def spec(i: int, steps: int, seq_len: int, batch_size: int, data: list[dict[str, str]]) -> TrialSpec:
    return TrialSpec(trial_id=f"t{i}", learning_rate=1e-4 * (i + 1), lora_rank=16, lora_alpha=32.0,
                     lora_dropout=0.05, batch_size=batch_size,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     seed=i, max_steps=steps, max_seq_len=seq_len, eval_interval=10**9, train_rows=data, val_rows=[])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--trials", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, base = materialise(args.shape, Path(tmp))
        data = make_rows(256, args.seq_len, seed=0, min_fraction=1.0)
        # Warm-up (CUDA context, kernels' autotuning, allocator) so the first row is not charged for it.
        model = load(base, device)
        train_pack(
            model, tokenizer, [spec(0, 3, args.seq_len, args.batch_size, data)],
            PackConfig(base_model_name=args.shape, export_dir=Path(tmp) / "warm"),
            PackCallbacks(on_point=lambda *a: None),
        )
        del model
        tokens_per_step = args.batch_size * args.seq_len
        table = []
        for k in args.trials:
            trials = [spec(i, args.steps, args.seq_len, args.batch_size, data) for i in range(k)]
            # One pack: the base model loaded once.
            t0 = time.perf_counter()
            model = load(base, device)
            sync()
            load_s = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
            t0 = time.perf_counter()
            train_pack(
                model, tokenizer, trials,
                PackConfig(base_model_name=args.shape, export_dir=Path(tmp) / "out"),
                PackCallbacks(on_point=lambda *a: None),
            )
            sync()
            pack_s = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            del model
            # The same trials one by one, each loading the base model (one trial per job).
            t0 = time.perf_counter()
            for trial in trials:
                model = load(base, device)
                train_pack(
                    model, tokenizer, [trial],
                    PackConfig(base_model_name=args.shape, export_dir=Path(tmp) / "out"),
                    PackCallbacks(on_point=lambda *a: None),
                )
                sync()
                del model
            separate_s = time.perf_counter() - t0
            tokens = k * args.steps * tokens_per_step
            table.append([k, round(load_s, 2), round(pack_s, 2), round(tokens / pack_s),
                          round(1000 * pack_s / (k * args.steps), 1), round(peak, 2), round(separate_s, 2),
                          round(separate_s / (load_s + pack_s), 2)])
    write_result(
        f"engine_pack-{args.shape}",
        ["trials", "load s", "pack s", "tokens/s", "ms/trial-step", "peak GiB", "separate s", "separate/pack"],
        table,
        {"shape": args.shape, "steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size,
         "lora": "rank 16, alpha 32, dropout 0.05, all 7 projections",
         "engine": "straightforward per-slot loop (issue 2); 'separate' reloads the base model per trial"},
    )


if __name__ == "__main__":
    main()
