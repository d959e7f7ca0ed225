"""Throughput of the training engine on one device: K trials in one pack (base model loaded once) against
the same K trials run one after another, each loading the base model itself (what a one-trial-per-job
service does). Random weights in real architectures' shapes: throughput does not depend on their values.

    python -m benchmarks.engine_pack --shape llama-3.2-1b --trials 1 4 8      # on a GPU
    python -m benchmarks.engine_pack --shape tiny --trials 1 4 --steps 5      # anywhere (smoke run)
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from benchmarks.common import write_result
from worker.engine import ModelSource, TrialSpec, load_base_model, train_pack

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
}


def rows(n: int, seq_len: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "theta", "kappa", "sigma"]

    def text(n_bytes: int) -> str:
        out = ""
        while len(out) < n_bytes:
            out += rng.choice(words) + " "
        return out[:n_bytes]

    return [{"prompt": text(seq_len // 2), "completion": text(seq_len // 2 - 2)} for _ in range(n)]


def spec(i: int, steps: int, seq_len: int, batch_size: int, data: list[dict[str, str]]) -> TrialSpec:
    return TrialSpec(trial_id=f"t{i}", learning_rate=1e-4 * (i + 1), lora_rank=16, lora_alpha=32.0,
                     lora_dropout=0.05, batch_size=batch_size,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     seed=i, max_steps=steps, max_seq_len=seq_len, eval_interval=10**9, train_rows=data, val_rows=[])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load(path: Path, device: torch.device) -> Any:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device)
    model.requires_grad_(False)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--trials", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp:
        _, tokenizer = load_base_model(ModelSource("tiny-random-llama", "tiny-random-llama"),
                                       cache_dir=Path(tmp), device=torch.device("cpu"))
        torch.manual_seed(0)
        config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=4096)
        LlamaForCausalLM(config).save_pretrained(Path(tmp) / "base")  # loaded from disk like a real model
        data = rows(256, args.seq_len, seed=0)
        # Warm-up (CUDA context, kernels' autotuning, allocator) so the first row is not charged for it.
        model = load(Path(tmp) / "base", device)
        train_pack(model, tokenizer, [spec(0, 3, args.seq_len, args.batch_size, data)], base_model_name=args.shape,
                   export_dir=Path(tmp) / "warm", on_point=lambda *a: None)
        del model
        tokens_per_step = args.batch_size * args.seq_len
        table = []
        for k in args.trials:
            trials = [spec(i, args.steps, args.seq_len, args.batch_size, data) for i in range(k)]
            # One pack: the base model loaded once.
            t0 = time.perf_counter()
            model = load(Path(tmp) / "base", device)
            sync()
            load_s = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
            t0 = time.perf_counter()
            train_pack(model, tokenizer, trials, base_model_name=args.shape, export_dir=Path(tmp) / "out",
                       on_point=lambda *a: None)
            sync()
            pack_s = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            del model
            # The same trials one by one, each loading the base model (one trial per job).
            t0 = time.perf_counter()
            for trial in trials:
                model = load(Path(tmp) / "base", device)
                train_pack(model, tokenizer, [trial], base_model_name=args.shape,
                           export_dir=Path(tmp) / "out", on_point=lambda *a: None)
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
