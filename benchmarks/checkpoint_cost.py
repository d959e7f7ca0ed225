"""What adapter checkpoints cost a pack (issue 35): the same pack of trials with `TrialSpec.adapter_checkpoints` off
and on, side by side, alternating, each repeated. On, each trial exports its adapter at every epoch's end and at its
last step, with its best adapter when that is older and not exported yet, and the callback stores each export as the
worker's `store_tar` does (the PEFT files in memory written as one plain tar, fsync'd and renamed into place, on the
pack's writer thread; the worker's store and its service dependencies are not needed here), so the difference is what
a user's trials pay for their checkpoints. Random weights in real architectures' shapes.

    python -m benchmarks.checkpoint_cost --shape smollm2-135m --trials 8 --repeats 3    # on a GPU
    python -m benchmarks.checkpoint_cost --shape tiny --trials 2 --steps 8 --repeats 1  # anywhere (smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.base_models import SHAPES, load, make_rows, materialise
from benchmarks.common import write_result
from benchmarks.engine_pack import spec, sync
from worker.engine import AdapterCheckpoint, PackCallbacks, PackConfig, TrialSpec, train_pack
from worker.engine.trainer import PackTimings


def pack_seconds(model: torch.nn.Module, tokenizer: object, trials: list[TrialSpec],
                 out: Path) -> tuple[float, int, dict[str, float | None]]:
    """Wall seconds of one pack (its writer's last files included), the checkpoints it wrote, and where its time
    went (`PackTimings`: steps, validation, exports on the training thread, the writer's persisting, the end's wait
    for the writer)."""
    written = []
    out.mkdir(parents=True, exist_ok=True)

    def keep(saved: AdapterCheckpoint) -> None:  # what the worker's store_tar does with the files
        target = out / f"{saved.trial_id}-{saved.step}.tar"
        staged = target.with_name(f".tmp-{target.name}")
        with staged.open("wb") as f:
            saved.files.write_tar(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, target)
        written.append(saved.step)

    timings = PackTimings()
    sync()
    started = time.perf_counter()
    train_pack(model, tokenizer, trials, PackConfig(base_model_name="bench", export_dir=out),  # type: ignore[arg-type]
               PackCallbacks(on_point=lambda *a: None, on_adapter_checkpoint=keep), timings=timings)
    sync()
    return time.perf_counter() - started, len(written), timings.summary()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rows", type=int, default=64, help="training rows: an epoch is rows / batch size steps")
    parser.add_argument("--eval-interval", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tokenizer, base = materialise(args.shape, tmp)
        rows = make_rows(args.rows + 16, args.seq_len, seed=0, min_fraction=1.0)
        model = load(base, device)

        def trials(checkpoints: bool) -> list[TrialSpec]:
            return [dataclasses.replace(spec(i, args.steps, args.seq_len, args.batch_size, rows[:args.rows]),
                                        val_rows=rows[args.rows:], eval_interval=args.eval_interval,
                                        adapter_checkpoints=checkpoints) for i in range(args.trials)]

        pack_seconds(model, tokenizer, trials(True)[:1], tmp / "warm")  # CUDA context, kernels, allocator
        seconds: dict[bool, list[float]] = {False: [], True: []}
        phases: dict[bool, list[dict[str, float | None]]] = {False: [], True: []}
        written = 0
        for repeat in range(args.repeats):
            for checkpoints in ((False, True) if repeat % 2 == 0 else (True, False)):
                out = tmp / f"run-{repeat}-{checkpoints}"
                out.mkdir()
                took, n, spent = pack_seconds(model, tokenizer, trials(checkpoints), out)
                seconds[checkpoints].append(took)
                phases[checkpoints].append(spent)
                print("checkpoints" if checkpoints else "none", round(took, 2), spent, flush=True)
                written = n if checkpoints else written
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    ratios = [b / a for a, b in zip(seconds[False], seconds[True], strict=True)]
    write_result(
        f"checkpoint_cost-{args.shape}",
        ["trials", "steps", "checkpoints written", "off s (median)", "on s (median)", "on/off (median)",
         "on/off (min-max)"],
        [[args.trials, args.steps, written, round(off, 2), round(on, 2), round(statistics.median(ratios), 3),
          f"{min(ratios):.3f}-{max(ratios):.3f}"]],
        {"shape": args.shape, "training_rows": args.rows, "eval_interval": args.eval_interval,
         "seq_len": args.seq_len, "batch_size": args.batch_size, "repeats": args.repeats,
         "seconds": {"off": seconds[False], "on": seconds[True]}, "phases": {"off": phases[False], "on": phases[True]},
         "lora": "rank 16, alpha 32, all 7 projections",
         "what": "one pack with adapter checkpoints off and on, alternating; on, each export stored as the worker's "
                 "store_tar stores it (one plain tar from memory, fsync, rename; on the writer thread)"},
    )


if __name__ == "__main__":
    main()
