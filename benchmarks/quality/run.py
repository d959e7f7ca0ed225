"""The quality benchmark through the service (issue 33): on each task, size and seed, what each way of choosing an
adapter scores on the held-out test rows.

    python -m benchmarks.quality.run --model smollm2-135m-instruct --seeds 0 1 2              # on a GPU
    python -m benchmarks.quality.run --model tiny-random-llama --tasks topics --sizes small --seeds 0 \\
        --train-rows 24 --test-rows 8 --arms base default grid-none oracle --grid-lr 1e-3 3e-3   # anywhere: a check

It starts the service as a user does (`loraplane up`, the embedded default, one worker) and, through the Python
client as one tenant, uploads each (task, size, seed)'s training and validation rows (benchmarks/quality/tasks.py)
and submits one task per arm:

- ``default``: the single trial of today's defaults (`common.search_space.DEFAULTS`, the training defaults);
- ``previous``: the single trial of the defaults before issue 17 (`benchmarks.defaults.BEFORE`);
- ``auto``: no search space: the grid the service picks (`auto_space`), its winner;
- ``grid-none``, ``grid-alto``, ``grid-asha``: a user's 18-trial grid (learning rate x rank x batch), its winner under
  each early-exit policy;
- ``refit``: ``grid-none``'s winner trained again on the training and validation rows (the task's `"refit": true`);

each trial's seed the task's seed. Then it downloads each task's best adapter (and, for ``oracle``, every trial's
adapter of ``grid-none``), loads them in PEFT on the same base model, and decodes the test rows greedily (the prompt
as the worker renders it for a generative metric, `worker.engine.data.eval_prompt`; the answer up to its first end
of turn or newline). ``base`` is the model without an adapter; ``oracle`` is the ``grid-none`` trial best on the
test rows (the ceiling of choosing among those trials); every ``grid-none`` trial's test score and validation curve
are kept, so that another way of picking the winner can be judged on them without training again. Prints, per task
and size, each arm's mean and 95% interval over the seeds (Student's t), and writes
benchmarks/results/quality-<model>-<device>-<date>.json with every score.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.defaults import BEFORE
from benchmarks.live_sweep import start_service, stop_service
from benchmarks.quality.stats import mean_ci
from benchmarks.quality.tasks import BENCHMARK, SIZES, TASKS, splits
from benchmarks.sweep import MODELS
from common.search_space import DEFAULTS
from loraplane.client import Client
from worker.engine import ModelSource, load_base_model
from worker.engine.data import eval_prompt

SOURCES = {"smollm2-135m-instruct": MODELS["smollm2"], "tiny-random-llama": MODELS["tiny"]}
ARMS = ("base", "default", "previous", "auto", "grid-none", "refit", "grid-alto", "grid-asha", "oracle")
SCORED_FROM_GRID = ("refit", "oracle")  # arms read off the grid-none task: its refit, every trial's adapter
TRAINED = ("default", "previous", "auto", "grid-none", "grid-alto", "grid-asha")
# Every test row of a cell in one greedy batch: on a GPU the decode is host-bound, a step per new token whatever the
# rows, so one batch of 256 costs about what one of 32 did (each adapter of an 18-trial grid is decoded).
DECODE_BATCH = 256
QUOTA = 100_000  # the benchmark's tenant's concurrent trials: 30 cells of 62 trials are 1,860


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SOURCES), default="smollm2-135m-instruct")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=BENCHMARK)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "large"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--grid-lr", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    parser.add_argument("--grid-rank", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--grid-batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--train-rows", type=int, help="the first N training rows only (a quick check)")
    parser.add_argument("--test-rows", type=int, help="the first N test rows only (a quick check)")
    parser.add_argument("--port", type=int, default=8439)
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds to wait for all tasks")
    return parser.parse_args()


def arm_spec(arm: str, args: argparse.Namespace, model: str, train_id: str, val_id: str, seed: int) -> dict[str, Any]:
    """The task a user would submit for ``arm``."""
    spec: dict[str, Any] = {"base_model": model, "training_file": train_id, "validation_file": val_id,
                            "epochs": args.epochs, "max_seq_len": args.max_seq_len, "seed": seed,
                            "early_exit": {"policy": "none"}}
    if arm == "default":
        # The learning rate left out: the service sets it by the model's size, as it does for a user.
        spec["search_space"] = {key: value for key, value in DEFAULTS.items() if key != "learning_rate"}
    elif arm == "previous":
        training = {key: BEFORE[key] for key in ("lr_schedule", "warmup_steps")}
        spec["search_space"] = {key: [value] for key, value in BEFORE.items() if key not in training}
        spec["training"] = training
    elif arm.startswith("grid-"):
        spec["search_space"] = {"learning_rate": args.grid_lr, "lora_rank": args.grid_rank,
                                "batch_size": args.grid_batch}
        spec["strategy"] = "grid"
        spec["early_exit"] = {"policy": arm.removeprefix("grid-")}
        if arm == "grid-none" and "refit" in args.arms:
            spec["refit"] = True
    elif arm != "auto":  # auto: no search space, the service's own grid
        raise ValueError(f"{arm} is not trained")
    return spec


@dataclass
class Cell:
    """One (task, size, seed): its tasks per arm, then each arm's test score."""

    task: str
    size: str
    seed: int
    rows: dict[str, list[dict[str, Any]]]
    task_ids: dict[str, str] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    winners: dict[str, dict[str, Any]] = field(default_factory=dict)


def submit(lp: Client, args: argparse.Namespace, model: str) -> list[Cell]:
    cells = []
    # Seed by seed: the service trains in submission order, so a run cut short has every task at its first seeds.
    for seed in args.seeds:
        for task in args.tasks:
            for size in args.sizes:
                rows = splits(task, size, seed)
                if args.train_rows:
                    rows["train"] = rows["train"][: args.train_rows]
                if args.test_rows:
                    rows["val"], rows["test"] = rows["val"][: args.test_rows], rows["test"][: args.test_rows]
                cell = Cell(task, size, seed, rows)
                files = {split: lp.files.upload(jsonl(rows[split]), filename=f"{task}-{size}-{seed}-{split}.jsonl").id
                         for split in ("train", "val")}
                for arm in (a for a in args.arms if a in TRAINED or a in SCORED_FROM_GRID):
                    submitted = "grid-none" if arm in SCORED_FROM_GRID else arm
                    if submitted not in cell.task_ids:
                        spec = arm_spec(submitted, args, model, files["train"], files["val"], seed)
                        cell.task_ids[submitted] = lp.tasks.create(spec).id
                cells.append(cell)
    return cells


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps({"messages": r["messages"]}).encode() + b"\n" for r in rows)


class Decoder:
    """Greedy answers of the base model with or without one of its downloaded adapters (PEFT)."""

    def __init__(self, source: ModelSource, cache: Path) -> None:
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model, self.tokenizer = load_base_model(source, cache_dir=cache, device=self.device)
        self.stop_ids = sorted({i for i in (self.tokenizer.eos_token_id,
                                            *_as_list(getattr(self.model.generation_config, "eos_token_id", None)))
                                if i is not None})

    def answers(self, rows: list[dict[str, Any]], max_new_tokens: int, adapter: Path | None) -> list[str]:
        """The answers to ``rows`` of the base model, or of the base with ``adapter`` (loaded for these rows only:
        PEFT's ``unload`` gives the bare base back)."""
        from peft import PeftModel

        if adapter is None:
            return self._decode(self.model, rows, max_new_tokens)
        adapted = PeftModel.from_pretrained(self.model, str(adapter))
        try:
            return self._decode(adapted, rows, max_new_tokens)
        finally:
            self.model = adapted.unload()

    def _decode(self, model: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> list[str]:
        prompts = [eval_prompt(row, self.tokenizer)[0] for row in rows]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        out: list[str] = []
        for start in range(0, len(prompts), DECODE_BATCH):
            batch = prompts[start:start + DECODE_BATCH]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
            with torch.no_grad():
                generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                           do_sample=False, eos_token_id=self.stop_ids, pad_token_id=pad)
            for row in generated[:, width:].tolist():
                cut = next((i for i, t in enumerate(row) if t in self.stop_ids), len(row))
                text = str(self.tokenizer.decode(row[:cut], skip_special_tokens=True)).strip()
                out.append(text.split("\n", 1)[0])
        return out


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def test_score(decoder: Decoder, cell: Cell, adapter: Path | None) -> float:
    """The held-out metric of the base (``adapter`` None) or of ``adapter`` on the cell's test rows."""
    task, test = TASKS[cell.task], cell.rows["test"]
    answers = decoder.answers(test, task.max_new_tokens, adapter)
    return sum(task.score(a, r["reference"]) for a, r in zip(answers, test, strict=True)) / len(test)


def scored_arms(args: argparse.Namespace) -> list[str]:
    return [a for a in ARMS if a in args.arms]


def task_of(arm: str) -> str | None:
    """The submitted arm whose task ``arm`` is scored from (None: ``base``, no task)."""
    if arm == "base":
        return None
    return "grid-none" if arm in SCORED_FROM_GRID else arm


def score_arm(lp: Client, cell: Cell, arm: str, decoder: Decoder, work: Path) -> None:
    """``arm``'s test score on ``cell`` (its task has ended); a failed task or refit leaves the arm without one."""
    if arm == "base":
        cell.scores["base"] = test_score(decoder, cell, None)
        return
    task_id = cell.task_ids[task_of(arm) or arm]
    final = lp.tasks.get(task_id)
    if final.state != "succeeded" or final.best_trial is None:
        print(f"{cell.task}/{cell.size}/{cell.seed} {arm}: task {task_id} {final.state}", flush=True)
        return
    if arm == "refit":
        # A failed refit leaves the task succeeded without a refit adapter: that cell has no refit score.
        if final.refit_trial_id is not None and lp.tasks.trial(task_id, final.refit_trial_id).adapter_ready:
            refit = lp.tasks.download_adapter(task_id, work / f"{task_id}-refit", refit=True)
            cell.scores["refit"] = test_score(decoder, cell, refit)
            cell.winners["refit"] = {"trial_id": final.refit_trial_id, "refit_of": final.best_trial.id}
        return
    if arm == "oracle":
        trials = [t for t in lp.tasks.trials(task_id).data if t.state == "completed" and t.refit_of is None]
        each = {t.id: test_score(decoder, cell, lp.tasks.download_adapter(task_id, work / t.id, trial_id=t.id))
                for t in trials}
        if each:
            best_id = max(each, key=lambda t: each[t])
            cell.scores["oracle"] = each[best_id]
            # Every trial's validation curve beside its test score: a rule that picks the winner another way (a
            # smoothed score, the last points) can be judged on these without training again.
            curves = {t.id: [[p.step, p.loss] for p in lp.tasks.metrics(task_id, t.id).val] for t in trials}
            cell.winners["oracle"] = {"trial_id": best_id, "all": each, "val_curves": curves,
                                      "hyperparameters": {t.id: t.hyperparameters for t in trials}}
        return
    adapter = lp.tasks.download_adapter(task_id, work / f"{task_id}-best")
    cell.scores[arm] = test_score(decoder, cell, adapter)
    # The training rows the search spent (steps x batch over its trials, the refit not among them): what early exit
    # saves against grid-none's, beside whether its winner is as good.
    samples = sum(t.steps_done * int(t.hyperparameters["batch_size"]) for t in lp.tasks.trials(task_id).data
                  if t.refit_of is None)
    cell.winners[arm] = {"trial_id": final.best_trial.id, "hyperparameters": final.best_trial.hyperparameters,
                         "best_val_loss": final.best_trial.best_val_loss, "samples": samples}


def main() -> None:
    args = parse_args()
    home = Path(tempfile.mkdtemp(prefix="loraplane-quality-"))
    admin_token = "lpadmin_" + secrets.token_urlsafe(16)
    grid = len(args.grid_lr) * len(args.grid_rank) * len(args.grid_batch)
    procs = start_service(home, args.port, admin_token, workers=1, slots=max(grid, 8))
    url = f"http://127.0.0.1:{args.port}"
    started = time.monotonic()
    try:
        with Client(url, admin_token=admin_token, timeout=120) as operator:
            # Every task is submitted at once (the planner packs them): the quota must hold all their trials.
            tenant = operator.admin.create_tenant("quality", max_concurrent_trials=QUOTA)
            key = operator.admin.create_api_key(tenant.id, name="quality").key
        assert key is not None
        with Client(url, key, timeout=120) as lp:
            cells = submit(lp, args, args.model)
            decoder = Decoder(SOURCES[args.model], home / "models")
            # Each arm of each cell is scored as soon as its task has ended, in whatever order that happens (the
            # planner runs short trials first, so a grid with a refit ends after the single trials of later cells),
            # while the service trains the rest on the same GPU: the decoding hides under the training. The result is
            # written again after each arm: a run cut short (the device's time ran out) keeps what it scored, marked
            # incomplete.
            pending = [(i, arm) for i in range(len(cells)) for arm in scored_arms(args)]
            while pending:
                if time.monotonic() - started > args.timeout:
                    raise TimeoutError(f"{len(pending)} arm(s) not scored after {args.timeout:.0f} s")
                waiting = {cells[i].task_ids[t] for i, arm in pending if (t := task_of(arm)) is not None}
                done = {task_id for task_id in waiting if lp.tasks.get(task_id).done}
                ready = [(i, arm) for i, arm in pending if (t := task_of(arm)) is None or cells[i].task_ids[t] in done]
                if not ready:
                    time.sleep(2.0)
                for i, arm in ready:
                    cell = cells[i]
                    score_arm(lp, cell, arm, decoder, home / "adapters")
                    pending.remove((i, arm))
                    value = cell.scores.get(arm)
                    print(f"{cell.task}/{cell.size}/seed {cell.seed} {arm}: "
                          + ("no score" if value is None else f"{value:.3f}"), flush=True)
                    report(args, [c for c in cells if c.scores or c.winners], time.monotonic() - started,
                           complete=not pending)
    finally:
        stop_service(procs)


def report(args: argparse.Namespace, cells: list[Cell], elapsed_s: float, *, complete: bool) -> None:
    arms = scored_arms(args)
    rows: list[list[Any]] = []
    for task in args.tasks:
        for size in args.sizes:
            mine = [c for c in cells if c.task == task and c.size == size]
            row: list[Any] = [task, size, len(mine)]
            for arm in arms:
                values = [c.scores[arm] for c in mine if arm in c.scores]
                if not values:
                    row.append("")
                    continue
                mean, half = mean_ci(values)
                row.append(f"{mean:.3f}" + ("" if half != half else f" ±{half:.3f}"))  # nan: one seed
            rows.append(row)
    write_result(f"quality-{args.model}", ["task", "size", "seeds", *arms], rows,
                 {"tasks": args.tasks, "sizes": args.sizes, "seeds": args.seeds, "epochs": args.epochs,
                  "grid": {"learning_rate": args.grid_lr, "lora_rank": args.grid_rank, "batch_size": args.grid_batch},
                  "train_rows": args.train_rows, "test_rows": args.test_rows, "max_seq_len": args.max_seq_len,
                  "elapsed_s": round(elapsed_s, 1), "complete": complete,
                  "cells": [{"task": c.task, "size": c.size, "seed": c.seed, "scores": c.scores,
                             "winners": c.winners, "task_ids": c.task_ids} for c in cells]})


if __name__ == "__main__":
    main()
