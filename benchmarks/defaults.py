"""The service's defaults measured on held-out rows (issue 17): a task's single-trial defaults against the ones it
had before, and the auto grid (`search_space` omitted) against the full 24-trial sweep of the same data.

    python -m benchmarks.sweep_data --out .sweepdata/seed0 --seed 0          # the data (once per seed)
    python -m benchmarks.defaults --dataset trivia --data .sweepdata/seed0 --seed 0     # on a GPU

One pack on SmolLM2-135M-Instruct, one epoch of the 2,000 training rows, validation at 20 points of each trial:
- `before`: the single trial a task without a search space got before issue 17: learning rate 2e-4, rank 8,
  alpha 16, batch 4, no dropout, adapters on q_proj and v_proj, constant learning rate, no warm-up; three seeds;
- `default`: the single trial of today's defaults (`common.search_space.DEFAULTS`: all linear layers; warm-up
  over 3% of the steps, then cosine), the same seeds;
- `auto`: the grid `common.search_space.auto_space` picks for this model and dataset, with today's training
  defaults; its winner by validation loss and by validation exact match (the service's ranking,
  `common.metrics.rank_key`).
Every trial's best-validation adapter is scored on the 512 held-out test rows as `benchmarks/sweep.py` scores the
sweep's (greedy decoding reproduces an accepted answer). Writes `benchmarks/results/defaults-<dataset>-seed<N>-*.json`;
the full sweeps of the same data and seeds (`benchmarks/sweep.py`) are the auto grid's yardstick (docs/defaults.md).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.sweep import MODELS, read, test_accuracy, val_exact_match
from common.metrics import rank_key
from common.search_space import DEFAULT_LR_SCHEDULE, auto_space, expand_grid, warmup_steps_for, with_size_defaults
from worker.engine import PackEngine, TrialSpec, load_base_model
from worker.engine.validation import evaluate

SEEDS = 3
# The defaults before issue 17 (api/search_space.py and the Training schema at commit c25af90).
BEFORE: dict[str, Any] = {
    "learning_rate": 2e-4, "lora_rank": 8, "lora_alpha": 16.0, "batch_size": 4, "lora_dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"], "lr_schedule": "constant", "warmup_steps": 0,
}


def trial(name: str, config: dict[str, Any], seed: int, train: list[dict[str, Any]], val: list[dict[str, Any]],
          max_seq_len: int, lr_schedule: str, warmup_steps: int | None) -> TrialSpec:
    steps = math.ceil(len(train) / config["batch_size"])
    targets = config["target_modules"]
    return TrialSpec(
        trial_id=name, learning_rate=config["learning_rate"], lora_rank=config["lora_rank"],
        lora_alpha=config["lora_alpha"], lora_dropout=config["lora_dropout"], batch_size=config["batch_size"],
        target_modules=[targets] if isinstance(targets, str) else list(targets), seed=seed, max_steps=steps,
        max_seq_len=max_seq_len, eval_interval=max(1, steps // 20), train_rows=train, val_rows=val,
        lr_schedule=lr_schedule, warmup_steps=warmup_steps_for(steps, warmup_steps),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", choices=["trivia", "arithmetic"], required=True)
    parser.add_argument("--data", type=Path, required=True, help="the folder benchmarks.sweep_data wrote")
    parser.add_argument("--seed", type=int, default=0, help="the data's seed (names the result; seeds the trials)")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--max-seq-len", type=int, default=96)
    parser.add_argument("--rows", type=int, nargs=3, metavar=("TRAIN", "VAL", "TEST"), help="the first rows only")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train, val, test = (read(args.data / args.dataset / f"{split}.jsonl") for split in ("train", "val", "test"))
    if args.rows:
        train, val, test = (rows[:n] for rows, n in zip((train, val, test), args.rows, strict=True))
    model, tokenizer = load_base_model(MODELS[args.model], cache_dir=Path(tempfile.gettempdir()) / "loraplane-models",
                                       device=device)
    parameters = sum(p.numel() for p in model.parameters())
    space = auto_space(parameters, len(train))
    base = args.seed * 1000
    specs: list[tuple[str, TrialSpec]] = []
    for k in range(SEEDS):
        specs.append(("before", trial(f"before-s{k}", BEFORE, base + k, train, val, args.max_seq_len,
                                      str(BEFORE["lr_schedule"]), int(BEFORE["warmup_steps"]))))
        # Today's single trial for this model: the learning rate by its size (1e-3 below 1B parameters since issue
        # 33; the committed results of 2026-11-24 trained the 2e-4 every size got then).
        default = expand_grid(with_size_defaults({}, parameters))[0]
        specs.append(("default", trial(f"default-s{k}", default, base + k, train, val, args.max_seq_len,
                                       DEFAULT_LR_SCHEDULE, None)))
    for i, config in enumerate(expand_grid(space)):
        name = f"auto-lr{config['learning_rate']:g}-r{config['lora_rank']}"
        specs.append(("auto", trial(name, config, base + 100 + i, train, val, args.max_seq_len, DEFAULT_LR_SCHEDULE,
                                    None)))

    started = time.perf_counter()
    engine = PackEngine(model, tokenizer, capacity=len(specs), max_rank=max(s.lora_rank for _, s in specs),
                        device=device)
    slots = {spec.trial_id: engine.admit(spec) for _, spec in specs}
    while any(state is not None and state.training for state in engine.slots):
        for trial_id in engine.step():
            if engine.state(slots[trial_id]).eval_due:
                evaluate(engine, slots[trial_id])
    train_s = time.perf_counter() - started
    results: list[dict[str, Any]] = []
    for group, spec in specs:
        slot, state = slots[spec.trial_id], engine.state(slots[spec.trial_id])
        if state.best is not None:
            engine.store.load_slot(slot, state.best, rank=spec.lora_rank, scale=state.config.scale)
        results.append({"group": group, "trial_id": spec.trial_id, "learning_rate": spec.learning_rate,
                        "lora_rank": spec.lora_rank, "target_modules": spec.target_modules,
                        "lr_schedule": spec.lr_schedule, "warmup_steps": spec.warmup_steps, "steps": state.steps_done,
                        "best_val_loss": state.best_val_loss,
                        "val_exact_match": val_exact_match(engine, slot, val, args.max_seq_len),
                        "test_accuracy": test_accuracy(engine, slot, test, args.max_seq_len)})
    engine.close()

    def mean(group: str, key: str) -> float:
        return round(statistics.fmean(r[key] for r in results if r["group"] == group), 4)

    auto = [r for r in results if r["group"] == "auto"]
    by_loss = min(auto, key=lambda r: r["best_val_loss"])
    by_metric = min(auto, key=lambda r: rank_key("exact_match", metric_score=r["val_exact_match"],
                                                 val_loss=r["best_val_loss"], last_train_loss=None, index=0))
    rows = [[r["trial_id"], r["learning_rate"], r["lora_rank"], "+".join(r["target_modules"]), r["lr_schedule"],
             r["warmup_steps"], round(r["best_val_loss"], 4), r["val_exact_match"], r["test_accuracy"]]
            for r in results]
    summary = {
        "dataset": args.dataset, "seed": args.seed, "model": MODELS[args.model].name, "parameters": parameters,
        "train_rows": len(train), "val_rows": len(val), "test_rows": len(test), "auto_space": space,
        "train_wall_s": round(train_s, 1),
        "before_mean_test_accuracy": mean("before", "test_accuracy"),
        "default_mean_test_accuracy": mean("default", "test_accuracy"),
        "before_mean_best_val_loss": mean("before", "best_val_loss"),
        "default_mean_best_val_loss": mean("default", "best_val_loss"),
        "auto_best_by_loss": by_loss["trial_id"], "auto_best_by_loss_test_accuracy": by_loss["test_accuracy"],
        "auto_best_by_metric": by_metric["trial_id"], "auto_best_by_metric_test_accuracy": by_metric["test_accuracy"],
        "results": results,
    }  # fmt: skip
    write_result(f"defaults-{args.dataset}-seed{args.seed}", ["trial", "lr", "rank", "modules", "schedule", "warm-up",
                 "best val loss", "val exact match", "test acc"], rows, summary)
    print({k: v for k, v in summary.items() if k != "results"})


if __name__ == "__main__":
    main()
