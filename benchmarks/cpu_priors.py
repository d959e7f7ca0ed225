"""The cost priors of a CPU worker (issue 32: a CPU task was estimated from the H100 priors, 200x too short).

Steps the real engine (worker/engine PackEngine, fp32 on the CPU, as a CPU worker runs it) on the tiny model's shape
and SmolLM2-135M's (random weights: the step time does not depend on their values), with the default trial (rank 8,
every linear layer, `common.search_space.DEFAULTS`) at a few pack sizes, on `LORAPLANE_WORKER_CPU_THREADS`'s default
of 2 threads. Each shape's steps are fitted with the planner's own fit (`cost.fit_profiles`, tokens counted as the
planner counts them: trials x batch x max_seq_len), and the two fits give the CPU priors of
scheduler/planning/cost.py: a per-token time that grows with the model's parameters (a CPU step is compute-bound).

    python -m benchmarks.cpu_priors
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.base_models import load, make_rows, materialise, projections
from benchmarks.common import write_result
from common.registry import DEFAULT_MODELS
from scheduler.planning.cost import ProfileSample, fit_profiles
from worker.engine.spec import TrialSpec

# (trials, batch, max_seq_len) of each measured pack.
PACKS = {
    "tiny": [(1, 1, 64), (4, 1, 64), (4, 4, 128), (8, 4, 256)],
    "smollm2-135m": [(1, 1, 64), (4, 1, 64), (4, 2, 128), (2, 4, 128)],
}
PARAMETERS = {"tiny": "tiny-random-llama", "smollm2-135m": "smollm2-135m-instruct"}  # registry names: their sizes


def specs(trials: int, batch: int, seq_len: int, shape: str) -> list[TrialSpec]:
    rows = make_rows(256, seq_len, seed=0)
    return [TrialSpec(trial_id=f"t{i}", learning_rate=2e-4, lora_rank=8, lora_alpha=16.0, lora_dropout=0.0,
                      batch_size=batch, target_modules=projections(shape), seed=i, max_steps=10**6,
                      max_seq_len=seq_len, eval_interval=10**9, train_rows=rows, val_rows=[])
            for i in range(trials)]


def step_seconds(model: Any, tokenizer: Any, pack: list[TrialSpec], warmup: int, steps: int) -> float:
    """Mean wall seconds of one engine step of `pack`, after `warmup` steps."""
    from worker.engine import PackEngine

    engine = PackEngine(model, tokenizer, capacity=len(pack), device=torch.device("cpu"), max_rank=8,
                        target_modules=pack[0].target_modules, activation_checkpointing=False)
    for spec in pack:
        engine.admit(spec)
    for _ in range(warmup):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - t0) / steps
    engine.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the worker's default: 2)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = {m.name: m.parameters for m in DEFAULT_MODELS}
    rows: list[list[Any]] = []
    fits: dict[str, dict[str, float]] = {}
    for shape, packs in PACKS.items():
        samples = []
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer, base = materialise(shape, Path(tmp))
            model = load(base, torch.device("cpu"))
            for trials, batch, seq_len in packs:
                seconds = step_seconds(model, tokenizer, specs(trials, batch, seq_len, shape), args.warmup,
                                       args.steps)
                tokens = trials * batch * seq_len
                samples.append(ProfileSample(trials, tokens, 0, seconds, None))
                rows.append([shape, trials, batch, seq_len, tokens, round(seconds, 4)])
        _, step = fit_profiles(samples)
        fits[shape] = {"parameters": float(sizes[PARAMETERS[shape]] or 0), "a_s": step.a_s,
                       "b_s_per_token": step.b_s_per_token, "c_s_per_slot": step.c_s_per_slot}
    write_result("cpu_priors", ["shape", "trials", "batch", "max_seq_len", "planner tokens", "step s"], rows, {
        "notes": "Engine steps on the CPU (fp32, rank 8, all linear layers, rows 50-100% of max_seq_len), fitted "
                 "per shape as the planner fits pack profiles (a + b x tokens + c x slots). The machine was shared "
                 "with other processes while measuring: the times are those of a busy CPU.",
        "threads": args.threads,
        "fits": fits,
    })


if __name__ == "__main__":
    main()
