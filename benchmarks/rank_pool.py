"""The worker over several devices (issue 20) on real devices: one pack through `worker/rank_pool.py` and
`worker/pack_runner.py`, the code path of `loraplane worker --gpus 0,1`, without the service around it (a file bus and a
local artifact store stand in for Redis; there is no database and no Celery).

    python -m benchmarks.rank_pool --devices cuda:0,cuda:1 --shape llama-3.1-8b --trials 16 --steps 30
    python -m benchmarks.rank_pool --devices cpu,cpu --shape tiny --trials 4 --steps 20      # the CPU, gloo

The same pack message runs twice: on the first device alone (a one-device worker's `PackRunner`, unless
`--no-single`), then over every device (`RankPool`: rank 0 in this process, a spawned process per other device,
each loading the model in host memory and sharding it onto its device). Each run's reports are read back from the
bus: every trial must complete all its steps. Tokens/s come from the pack's own profile (its steps summed over the
ranks, real tokens only), over the steps after `--warmup`. Each trial's final training loss is compared between the
runs (bf16 on CUDA: close, not equal; the CPU tests show the adapters equal in fp32). Results:
benchmarks/results/rank_pool-<shape>-<N>dev-<device>-<date>.json. With `--engine`, the same trials are first stepped by
the engine alone on the first device (no worker loop around it), side by side in the same run. Every configuration
runs `--repeat` times (default 2) and the last is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.base_models import SHAPES, make_rows, materialise, projections
from benchmarks.common import write_result

if TYPE_CHECKING:
    from common.messages import PackMessage

RANKS = (16, 32, 64)


def training_file(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def pack_message(pack_id: str, model_dir: Path, trials: int, steps: int, seq_len: int, batch: int,
                 targets: list[str]) -> PackMessage:
    """A pack message as scheduler/service/dispatch.py builds it."""
    from common.messages import ModelSourceFields, PackMessage, TrialPayload

    def trial(i: int) -> TrialPayload:
        rank = RANKS[i % len(RANKS)]
        return TrialPayload(
            trial_id=f"{pack_id}-t{i:02d}", task_id="task-bench", total_steps=steps, max_seq_len=seq_len,
            eval_interval=10**9, training_file_key="files/bench.jsonl", validation_file_key=None,
            validation_split=None, split_seed=0, training={}, evaluation=None, resume_key=None,
            extra_eval_steps=[], placed_at=None,
            hyperparameters={"learning_rate": 1e-4 * (1 + i % 4), "lora_rank": rank, "lora_alpha": 2.0 * rank,
                             "lora_dropout": 0.0, "batch_size": batch, "target_modules": targets, "seed": i},
        )

    return PackMessage(pack_id=pack_id, worker_id="bench", trials=[trial(i) for i in range(trials)],
                       base_model=ModelSourceFields(name="bench-model", kind="hf", path=str(model_dir)),
                       capacity=trials, max_rank=max(RANKS), target_modules=targets)


def run_pack(devices: list[str], pack: PackMessage, timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    """The pack on ``devices`` as a worker runs it; (its reports, wall seconds)."""
    from common.artifacts import get_artifact_store
    from common.bus import SCHEDULER_STREAM, get_bus
    from common.settings import get_settings
    from worker.heartbeat import Heartbeat, Incarnation
    from worker.main import rank_main
    from worker.pack_runner import PackRunner
    from worker.rank_pool import RankConfig, RankPool, free_port

    bus, incarnation = get_bus(), Incarnation()
    pool = ranks = None
    if len(devices) > 1:
        pool = RankPool(RankConfig(worker_id="bench", devices=tuple(devices), init_method=f"tcp://127.0.0.1:{free_port()}",
                                   incarnation=incarnation, timeout_s=timeout_s, cpu_threads=0), entry=rank_main)
        ranks = pool.start()
    heartbeat = Heartbeat(bus, 60.0, {"worker_id": "bench"}, incarnation)  # not started: run() only names the pack
    runner = PackRunner(worker_id="bench", device=torch.device(devices[0]), bus=bus, store=get_artifact_store(),
                        model_cache_dir=get_settings().resolved_model_cache_dir, heartbeat=heartbeat, ranks=ranks,
                        pool=pool)
    tail = bus.tail_id(SCHEDULER_STREAM)
    started = time.perf_counter()
    try:
        runner.run(pack)
    finally:
        if pool is not None:
            pool.close()
            torch.distributed.destroy_process_group()  # a later run starts a pool of its own
    wall = time.perf_counter() - started
    return [m for _, m in bus.read_after(SCHEDULER_STREAM, tail, count=10**6, block_s=0)], wall


def summary(reports: list[dict[str, Any]], pack: PackMessage, warmup: int) -> dict[str, Any]:
    kinds = [r["type"] for r in reports]
    failed = [r for r in reports if r["type"] == "pack.failed"]
    assert not failed, failed
    assert kinds[0] == "pack.started" and kinds[-1] == "pack.finished", kinds
    finished = {r["trial_id"]: r for r in reports if r["type"] == "trial.finished"}
    steps = {t.trial_id: t.total_steps for t in pack.trials}
    assert {t: (r["status"], r["steps_done"]) for t, r in finished.items()} == {
        t: ("completed", n) for t, n in steps.items()}, finished
    (profile,) = [r["profile"] for r in reports if r["type"] == "pack.profile"]
    fields = profile["sample_fields"]
    measured = profile["samples"][warmup:]
    tokens = sum(s[fields.index("tokens")] for s in measured)
    seconds = sum(s[fields.index("seconds")] for s in measured)
    peaks = [s[fields.index("peak_memory_bytes")] or 0 for s in measured]
    return {"tokens_per_s": tokens / seconds, "steps": len(measured), "peak_gib": max(peaks, default=0) / 2**30,
            "gpus": profile.get("gpus", 1), "losses": {t[-3:]: r["final_train_loss"] for t, r in finished.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cuda:0,cuda:1", help="comma list, e.g. cuda:0,cuda:1 or cpu,cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first L decoder layers")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="the pack's first steps, left out of tokens/s")
    parser.add_argument("--no-single", action="store_true", help="skip the one-device run (the model does not fit)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each configuration; the last is measured")
    parser.add_argument("--engine", action="store_true",
                        help="also step the same trials with the engine alone on the first device (no worker loop)")
    parser.add_argument("--timeout", type=float, default=900.0, help="LORAPLANE_WORKER_RANK_TIMEOUT_S of the ranks")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("LORAPLANE_BENCH_DIR", tempfile.gettempdir())))
    args = parser.parse_args()
    devices = args.devices.split(",")

    work = Path(tempfile.mkdtemp(prefix="rank_pool-"))
    # A file bus and a local store of this run's own (no Redis: REDIS_URL is dropped for the run and its ranks).
    os.environ.pop("REDIS_URL", None)
    os.environ.update(LORAPLANE_HOME=str(work / "home"), LORAPLANE_ARTIFACT_DIR=str(work / "artifacts"),
                      LORAPLANE_MODEL_CACHE=str(work / "models"), HF_HUB_OFFLINE="1")
    from common.artifacts import get_artifact_store

    model_dir = args.dir / f"rank_pool-{args.shape}-{args.layers}"
    tokenizer, base = materialise(args.shape, model_dir, layers=args.layers)
    tokenizer.save_pretrained(base)  # a registered model directory holds its tokenizer
    get_artifact_store().put_bytes("files/bench.jsonl", training_file(make_rows(64, args.seq_len, seed=0)))
    targets = projections(args.shape)

    # Every configuration runs `--repeat` times and the last is measured: the first compiles and autotunes the
    # kernels (per process and shape) for all of them, so none profits from another's warm caches.
    for attempt in range(args.repeat):
        runs: list[tuple[str, dict[str, Any], float]] = []
        if args.engine:
            runs.append(engine_alone(args, base, devices[0], targets))
        if not args.no_single:
            pack = pack_message(f"pack-one-{attempt}", base, args.trials, args.steps, args.seq_len, args.batch,
                                targets)
            reports, wall = run_pack(devices[:1], pack, args.timeout)
            runs.append(("one device", summary(reports, pack, args.warmup), wall))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if len(devices) > 1:  # one device: the one-device worker's path alone (a check of the set-up)
            pack = pack_message(f"pack-all-{attempt}", base, args.trials, args.steps, args.seq_len, args.batch,
                                targets)
            reports, wall = run_pack(devices, pack, args.timeout)
            runs.append((f"{len(devices)} devices, rank pool", summary(reports, pack, args.warmup), wall))
    report(args, devices, runs)


def engine_alone(args: argparse.Namespace, base: Path, device: str, targets: list[str]
                 ) -> tuple[str, dict[str, Any], float]:
    """The same trials on the same device, stepped by the engine alone (`benchmarks/multi_gpu.py`'s loop: admit,
    then step): what the worker's loop around the engine (reports, the command inbox, the trainer's phases) adds."""
    from transformers import AutoTokenizer

    from benchmarks.base_models import load
    from benchmarks.multi_gpu import train, trial_specs

    started = time.perf_counter()
    specs = trial_specs(args.trials, args.batch, args.seq_len, make_rows(64, args.seq_len, seed=0), targets)
    seconds, tokens, _, peak = train(load(base, torch.device(device)), AutoTokenizer.from_pretrained(base), specs,
                                     torch.device(device), args.warmup, args.steps - args.warmup, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return "engine alone", {"tokens_per_s": tokens / seconds, "gpus": 1, "peak_gib": peak / 2**30,
                            "steps": args.steps - args.warmup, "losses": None}, time.perf_counter() - started


def report(args: argparse.Namespace, devices: list[str], runs: list[tuple[str, dict[str, Any], float]]) -> None:
    # Ratios against the one-device worker (the first run with losses, the pack as the service runs it).
    base = next((s for _, s, _ in runs if s["losses"] is not None), None) if len(runs) > 1 else None
    rows: list[list[Any]] = []
    for label, s, wall in runs:
        ratio = round(s["tokens_per_s"] / base["tokens_per_s"], 2) if base is not None else ""
        diff = (max(abs(s["losses"][t] - base["losses"][t]) / abs(base["losses"][t]) for t in s["losses"])
                if base is not None and s is not base and s["losses"] is not None else "")
        rows.append([label, s["gpus"], round(s["tokens_per_s"]), ratio, round(s["peak_gib"], 1), round(wall, 1),
                     f"{diff:.1e}" if diff != "" else ""])
    write_result(f"rank_pool-{args.shape}-{len(devices)}dev",
                 ["run", "gpus", "tokens/s", "x one-device worker", "peak GiB (pack)", "wall s",
                  "final loss rel diff"], rows,
                 {"shape": args.shape, "layers": args.layers, "trials": args.trials, "batch": args.batch,
                  "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "devices": devices})


if __name__ == "__main__":
    main()
