"""DPO in a pack against the plain way (issue 36): 16 DPO configurations (learning rate x beta) of one base model
trained as one pack of the engine (worker/engine/dpo.py), beside TRL's `DPOTrainer` with a PEFT LoRA adapter training
the same configurations one at a time — what a careful user runs — on the same pairs, in the same order, for the same
steps; and the same pack with the reference pass unshared (every trial's reference log-probabilities computed at each
of its steps, as a trainer of one adapter does), to measure what computing them once per pair saves. Random weights in
a real architecture's shape (`benchmarks.base_models.build`), the byte-level tokenizer (a token a byte).

    python -m benchmarks.dpo --shape llama-3.2-1b --steps 20                  # on a GPU
    python -m benchmarks.dpo --shape tiny --trials 2 --steps 3 --seq-len 64   # anywhere (smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.base_models import SHAPES, build, make_rows, tiny_tokenizer
from benchmarks.common import write_result
from benchmarks.engine_pack import sync
from worker.engine import PackCallbacks, PackConfig, TrialSpec, train_pack
from worker.engine import dpo as dpo_module
from worker.engine.data import BatchSampler
from worker.engine.spec import DpoObjective, trial_seed
from worker.engine.trainer import PackTimings

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LEARNING_RATES = (5e-6, 1e-5, 5e-5, 1e-4)
BETAS = (0.05, 0.1, 0.3, 0.5)


def preference_rows(n: int, seq_len: int, seed: int) -> list[dict[str, str]]:
    """Pairs whose prompt and longer answer fill 50-100% of seq_len bytes: `make_rows`' prompt and completion, and a
    rejected answer of about the completion's length."""
    rng = random.Random(seed + 1)
    rows = []
    for row in make_rows(n, seq_len, seed):
        words = row["completion"].split()
        rng.shuffle(words)
        rows.append({"prompt": row["prompt"], "chosen": row["completion"],
                     "rejected": " ".join(words)[: len(row["completion"])] or "x"})
    return rows


def specs(n: int, steps: int, seq_len: int, batch_size: int, rows: list[dict[str, str]]) -> list[TrialSpec]:
    """The first ``n`` configurations of the learning rate x beta grid (rank 16 on all seven projections)."""
    grid = list(itertools.product(LEARNING_RATES, BETAS))[:n]
    return [TrialSpec(trial_id=f"t{i}", learning_rate=lr, lora_rank=16, lora_alpha=32.0, lora_dropout=0.05,
                      batch_size=batch_size, target_modules=PROJECTIONS, seed=i, max_steps=steps, max_seq_len=seq_len,
                      eval_interval=10**9, train_rows=rows, val_rows=[], dpo=DpoObjective(beta=beta))
            for i, (lr, beta) in enumerate(grid)]


@contextlib.contextmanager
def reference_timer(clock: dict[str, float], *, shared: bool) -> Iterator[None]:
    """Times the reference passes (`dpo.fill_references`, synced on both sides); unshared, every requested pair
    counts as missing, so each trial's pairs are run through the base at each of its steps."""
    fill, missing = dpo_module.fill_references, dpo_module.ReferenceCache.missing

    def timed(*args: Any, **kwargs: Any) -> None:
        sync()
        started = time.perf_counter()
        fill(*args, **kwargs)
        sync()
        clock["reference_s"] += time.perf_counter() - started

    def all_missing(self: dpo_module.ReferenceCache, key: Any, items: Any) -> list[int]:
        return sorted(set(items))

    dpo_module.fill_references = timed
    if not shared:
        dpo_module.ReferenceCache.missing = all_missing  # type: ignore[method-assign]
    try:
        yield
    finally:
        dpo_module.fill_references = fill
        dpo_module.ReferenceCache.missing = missing  # type: ignore[method-assign]


def engine_pack(model: Any, tokenizer: Any, trials: list[TrialSpec], out: Path, *, shared: bool) -> dict[str, float]:
    clock = {"reference_s": 0.0}
    timings = PackTimings()
    sync()
    started = time.perf_counter()
    with reference_timer(clock, shared=shared):
        outcomes = train_pack(model, tokenizer, trials, PackConfig(base_model_name="bench", export_dir=out),
                              PackCallbacks(on_point=lambda *a: None), timings=timings)
    sync()
    wall = time.perf_counter() - started
    assert all(o.status == "completed" for o in outcomes), [(o.trial_id, o.error) for o in outcomes]
    return {"wall_s": wall, "steps_s": timings.steps_s, "reference_s": clock["reference_s"],
            "tokens": float(sum(o.pack_tokens for o in outcomes))}


def trl_one(model: Any, tokenizer: Any, spec: TrialSpec, out: Path, bf16: bool) -> dict[str, float]:
    """One configuration trained alone by TRL's DPOTrainer with a PEFT LoRA adapter (the model unwrapped after)."""
    import datasets
    import peft
    from trl import DPOConfig, DPOTrainer

    assert spec.dpo is not None
    sampler = BatchSampler(len(spec.train_rows), spec.batch_size, trial_seed(spec.seed, "data"))
    order = [i for _ in range(spec.max_steps) for i in sampler.next_indices()]  # the pairs the pack's trial reads
    # transformers 5.24 renamed gradient_checkpointing (TRL's default: on) to activation_checkpointing.
    recompute: dict[str, Any] = {("activation_checkpointing" if "activation_checkpointing" in
                                  DPOConfig.__dataclass_fields__ else "gradient_checkpointing"): False}
    config = DPOConfig(
        output_dir=str(out), report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), bf16=bf16, **recompute, seed=spec.seed,
        max_steps=spec.max_steps, per_device_train_batch_size=spec.batch_size, train_sampling_strategy="sequential",
        learning_rate=spec.learning_rate, lr_scheduler_type="constant", max_grad_norm=0.0,
        beta=spec.dpo.beta, max_length=spec.max_seq_len, precompute_ref_log_probs=False)
    started = time.perf_counter()
    trainer: Any = DPOTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list([spec.train_rows[i] for i in order]),
                         peft_config=peft.LoraConfig(r=spec.lora_rank, lora_alpha=int(spec.lora_alpha),
                                                     lora_dropout=spec.lora_dropout,
                                                     target_modules=list(spec.target_modules)))
    sync()
    setup = time.perf_counter() - started
    started = time.perf_counter()
    trainer.train()
    sync()
    train = time.perf_counter() - started
    trainer.model.unload()  # the bare base again, for the next configuration
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"setup_s": setup, "train_s": train}


def _mean(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--baseline-trials", type=int, help="TRL trains this many of them (default: all)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per step")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="runs of the pack each way, alternating")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tiny_tokenizer(Path(tmp))
        model = build(args.shape, device)
        rows = preference_rows(args.rows, args.seq_len, seed=0)
        trials = specs(args.trials, args.steps, args.seq_len, args.batch_size, rows)
        # The whole pack once first: CUDA context, allocator, and the LoRA kernels' autotuning for the stream's
        # lengths (on an H100 a first pack took 92 s where the same pack after it took 23 s).
        engine_pack(model, tokenizer, trials, Path(tmp) / "warm", shared=True)
        runs_shared, runs_unshared = [], []
        for repeat in range(args.repeats):  # alternating, so that a drift of the machine falls on both
            runs_shared.append(engine_pack(model, tokenizer, trials, Path(tmp) / f"shared{repeat}", shared=True))
            runs_unshared.append(engine_pack(model, tokenizer, trials, Path(tmp) / f"unshared{repeat}",
                                             shared=False))
            print("shared", runs_shared[-1], "unshared", runs_unshared[-1], flush=True)
        shared, unshared = _mean(runs_shared), _mean(runs_unshared)
        baseline = trials[: args.baseline_trials or len(trials)]
        bf16 = device.type == "cuda"
        trl_one(model, tokenizer, specs(1, 2, args.seq_len, args.batch_size, rows)[0], Path(tmp) / "trl-warm", bf16)
        runs = [trl_one(model, tokenizer, spec, Path(tmp) / f"trl-{spec.trial_id}", bf16) for spec in baseline]
        print("trl", runs, flush=True)
    scale = len(trials) / len(baseline)  # every configuration costs TRL the same steps of the same pairs
    trl_train = sum(r["train_s"] for r in runs) * scale
    trl_setup = sum(r["setup_s"] for r in runs) * scale
    tokens = shared["tokens"]
    table = [
        [f"engine pack, reference shared (mean of {args.repeats})", round(shared["wall_s"], 2),
         round(shared["reference_s"], 2),
         round(tokens / shared["wall_s"]), 1.0],
        [f"engine pack, reference per trial and step (mean of {args.repeats})", round(unshared["wall_s"], 2),
         round(unshared["reference_s"], 2),
         round(tokens / unshared["wall_s"]), round(unshared["wall_s"] / shared["wall_s"], 3)],
        ["TRL DPOTrainer + PEFT, one at a time (train)", round(trl_train, 2), None, round(tokens / trl_train),
         round(trl_train / shared["wall_s"], 3)],
        ["TRL, with its set-up (tokenising, wrapping)", round(trl_train + trl_setup, 2), None,
         round(tokens / (trl_train + trl_setup)), round((trl_train + trl_setup) / shared["wall_s"], 3)],
    ]
    write_result(
        f"dpo-{args.shape}",
        ["run", "wall s", "reference s", "tokens/s", "x shared pack's time"],
        table,
        {"shape": args.shape, "trials": args.trials, "baseline_trials": len(baseline), "steps": args.steps,
         "seq_len": args.seq_len, "batch_size_pairs": args.batch_size, "rows": args.rows, "tokens": tokens,
         "grid": {"learning_rate": LEARNING_RATES, "beta": BETAS},
         "lora": "rank 16, alpha 32, dropout 0.05, all 7 projections; sigmoid DPO loss",
         "reference_share_saved": round(1 - shared["wall_s"] / unshared["wall_s"], 4),
         "engine_runs": {"shared": runs_shared, "unshared": runs_unshared},
         "trl": "DPOTrainer (trl 1.16) with peft_config, bf16 on CUDA, no recompute, no clipping, constant lr, "
                "padded batches (its default), the reference from the adapter-disabled model at each step; "
                "trials run one after another in this process on the same model object"
                + (f"; {len(baseline)} of the {len(trials)} configurations run, scaled by {scale:g}"
                   if scale != 1 else ""),
         "tokens_counted": "real tokens of each pair's chosen and rejected sequences, over every trial's steps "
                           "(the pack's own count; TRL trains the same pairs)",
         "trl_runs": runs},
    )


if __name__ == "__main__":
    main()
