"""Issue 30: does the engine's speed reach the user? A grid task through the whole service against the engine alone.

    python -m benchmarks.service_speed --data .sweepdata --dataset arithmetic             # SmolLM2-135M, on a GPU
    python -m benchmarks.service_speed --data .sweepdata --dataset arithmetic --shape llama-3.2-1b \\
        --policies none --batches 2 4 --ranks 8 16 --rows 1200 100 0                    # the 1B shape, 16 trials
    python -m benchmarks.service_speed --data .sweepdata --dataset arithmetic --model tiny-random-llama \\
        --rows 48 8 0 --batches 4 8 --ranks 4 --lrs 1e-3 3e-3 --policies none none     # anywhere: the phase table

It starts the service as a user does (`loraplane up`: the embedded default, one worker: one worker per GPU), and
submits through the Python client one grid task after another on the same base model (``--policies``, default
``none none alto``: the first task finds the worker cold, the later ones warm). For each task: submit → succeeded,
the GPU's busy share sampled through NVML from its submission to its end, and its pack's profile (where the pack's
wall time went: load, capture, steps, validation, metric, snapshot, persist, export, idle, other; and its first
step after the pack's start). Then it stops the service and, in the same process on the same device, trains the
first task's trials with ``train_pack`` alone — the same trial specs, rows, steps and validation, the model already
loaded, no checkpoints, no reports: the ceiling the service is held to. Prints a table of both and writes
``benchmarks/results/service_speed-<model>-<device>-<date>.json`` with device, date, commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, command_line, device_description, git_commit, print_table
from benchmarks.live_sweep import ALL_LINEAR, GpuBusy, pack_profiles, start_service, stop_service
from benchmarks.sweep import MODELS, read
from common.messages import TrialPayload
from loraplane.client import Client
from worker.engine import ModelSource, PackCallbacks, PackConfig, TrialSpec, load_base_model, train_pack
from worker.engine.trainer import PackTimings
from worker.pack_runner import PackRunner

PHASES = ("load_s", "capture_s", "steps_s", "validation_s", "metric_s", "snapshot_s", "persist_s", "export_s",
          "idle_s")
SOURCES = {"smollm2-135m-instruct": MODELS["smollm2"], "tiny-random-llama": MODELS["tiny"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True, help="the folder benchmarks.sweep_data wrote")
    parser.add_argument("--dataset", choices=["trivia", "arithmetic"], default="arithmetic")
    parser.add_argument("--model", choices=sorted(SOURCES), default="smollm2-135m-instruct")
    parser.add_argument("--shape", help="instead of --model: a random-weight directory of this benchmarks.base_models "
                                        "shape, registered with the service (llama-3.2-1b)")
    parser.add_argument("--policies", nargs="+", default=["none", "none", "alto"], choices=["none", "alto", "asha"])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rows", type=int, nargs=2, metavar=("TRAIN", "VAL"), help="the first rows of each split")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-seq-len", type=int, default=96)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    home = Path(tempfile.mkdtemp(prefix="loraplane-speed-"))
    splits = [read(args.data / args.dataset / f"{split}.jsonl") for split in ("train", "val")]
    if args.rows:
        splits = [rows[:n] for rows, n in zip(splits, args.rows, strict=True)]
    grid = len(args.lrs) * len(args.ranks) * len(args.batches)
    admin_token = "lpadmin_" + secrets.token_urlsafe(16)
    procs = start_service(home, args.port, admin_token, workers=1, slots=grid)
    base = f"http://127.0.0.1:{args.port}"
    try:
        model_name, source = register(base, admin_token, args, home)
        with Client(base, admin_token=admin_token, timeout=60) as operator:
            tenant = operator.admin.create_tenant("speed", max_concurrent_trials=grid)
            key = operator.admin.create_api_key(tenant.id, name="speed").key
        assert key is not None
        lp = Client(base, key, timeout=60)
        files = [lp.files.upload(b"".join(json.dumps({"messages": r["messages"]}).encode() + b"\n" for r in rows),
                                 filename=f"{args.dataset}-{split}.jsonl").id
                 for rows, split in zip(splits, ("train", "val"), strict=True)]
        gpu = GpuBusy().start()
        t0 = time.monotonic()
        tasks = [run_task(lp, args, model_name, files, policy, gpu, t0) for policy in args.policies]
        gpu.stop()
        first_trials = lp.tasks.trials(tasks[0]["task_id"]).data
        lp.close()
        packs = {p["pack_id"]: p for p in pack_profiles(home)}
    finally:
        stop_service(procs)
    for task in tasks:
        task["packs"] = [p for p in packs.values() if set(p["trial_ids"]) & set(task["trial_ids"])]
    alone = engine_alone(args, source, first_trials, splits)
    report(args, tasks, alone)


def register(base: str, admin_token: str, args: argparse.Namespace, home: Path) -> tuple[str, ModelSource]:
    """The model the tasks train on: a default registry entry, or a random-weight directory of ``--shape``
    registered now (tokenizer saved beside it)."""
    if not args.shape:
        return args.model, SOURCES[args.model]
    from benchmarks.base_models import materialise

    tokenizer, directory = materialise(args.shape, home / "model")
    tokenizer.save_pretrained(directory)
    name = f"random-{args.shape}"
    with Client(base, admin_token=admin_token, timeout=300) as operator:
        operator.admin.register_model(name, str(directory), description=f"random weights, {args.shape} shape")
    return name, ModelSource(name=name, kind="hf", path=str(directory))


def run_task(lp: Client, args: argparse.Namespace, model: str, files: list[str], policy: str, gpu: GpuBusy,
             t0: float) -> dict[str, Any]:  # fmt: skip
    """Submits one grid task and waits for its end: its wall-clock and the GPU's busy share over it."""
    spec = {
        "base_model": model, "training_file": files[0], "validation_file": files[1],
        "search_space": {"learning_rate": list(args.lrs), "lora_rank": list(args.ranks),
                         "batch_size": list(args.batches), "lora_dropout": [0.05], "target_modules": [ALL_LINEAR]},
        "strategy": "grid", "epochs": args.epochs, "max_seq_len": args.max_seq_len,
        "eval_interval": args.eval_interval, "early_exit": {"policy": policy}, "seed": 0,
        "scheduling": {"max_trials_per_pack": len(args.lrs) * len(args.ranks) * len(args.batches)},
    }  # fmt: skip
    submitted = time.monotonic()
    task = lp.tasks.create(spec)
    deadline = submitted + args.timeout
    while not task.done:
        if time.monotonic() > deadline:
            raise SystemExit(f"task {task.id} not done in {args.timeout:.0f} s")
        time.sleep(0.5)
        task = lp.tasks.get(task.id)
    ended = time.monotonic()
    trials = lp.tasks.trials(task.id).data
    window = [u for at, u in gpu.samples if submitted - t0 <= at <= ended - t0]
    trained = sum(t.steps_done * int(t.hyperparameters["batch_size"]) for t in trials)
    full = sum(t.total_steps * int(t.hyperparameters["batch_size"]) for t in trials)
    print(f"task {policy}: {task.state} in {ended - submitted:.1f} s", flush=True)
    return {"task_id": task.id, "policy": policy, "state": task.state, "wall_s": round(ended - submitted, 2),
            "gpu_busy_pct": round(sum(window) / len(window), 1) if window else None,
            "trial_ids": [t.id for t in trials], "trials": len(trials),
            "steps": sum(t.steps_done for t in trials), "samples_saved_frac": round(1 - trained / full, 4)}


def engine_alone(args: argparse.Namespace, source: ModelSource, trials: list[Any],
                 splits: list[list[dict[str, Any]]]) -> dict[str, Any]:  # fmt: skip
    """The first task's trials trained by ``train_pack`` in this process: same specs, rows and validation, the
    steps each trial trained in the service; the model loaded (and the device warmed up) before the clock."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_base_model(source, cache_dir=Path(tempfile.gettempdir()) / "loraplane-models",
                                       device=device)
    train, val = ([{"messages": r["messages"]} for r in rows] for rows in splits)
    specs = [trial_spec(t, args, train, val) for t in trials]
    with tempfile.TemporaryDirectory() as tmp:
        warm = [trial_spec(trials[0], args, train, val, steps=3)]
        train_pack(
            model, tokenizer, warm,
            PackConfig(base_model_name=source.name, export_dir=Path(tmp) / "warm"),
            PackCallbacks(on_point=lambda *p: None),
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings = PackTimings()
        started = time.perf_counter()
        train_pack(
            model, tokenizer, specs,
            PackConfig(base_model_name=source.name, export_dir=Path(tmp) / "out", capacity=len(specs)),
            PackCallbacks(on_point=lambda *p: None),
            timings=timings,
        )
        wall = time.perf_counter() - started
    print(f"engine alone: {len(specs)} trials in {wall:.1f} s", flush=True)
    return {"wall_s": round(wall, 2), "trials": len(specs), "steps": sum(s.max_steps for s in specs),
            "phases": timings.summary()}


def trial_spec(trial: Any, args: argparse.Namespace, train: list[dict[str, Any]], val: list[dict[str, Any]],
               steps: int | None = None) -> TrialSpec:  # fmt: skip
    """The spec the worker built for ``trial`` (``PackRunner.trial_spec`` on the pack message's trial: the task's
    defaults for what it left out), ``steps`` long if given."""
    message = TrialPayload(trial_id=trial.id, task_id=trial.task_id, hyperparameters=trial.hyperparameters,
                           total_steps=steps or int(trial.total_steps), max_seq_len=args.max_seq_len,
                           eval_interval=args.eval_interval, training_file_key="train", validation_file_key="val",
                           split_seed=0, training={})  # fmt: skip
    return PackRunner.trial_spec(message, {"train": train, "val": val}.__getitem__)


def task_phases(packs: list[dict[str, Any]]) -> dict[str, float]:
    """The phases of a task's packs, summed (an early-exit task runs its trials in several packs)."""
    total: dict[str, float] = {}
    for pack in packs:
        for name, value in (pack["profile"].get("phases") or {}).items():
            if isinstance(value, int | float) and name.endswith("_s"):
                total[name] = total.get(name, 0.0) + float(value)
    return total


def phase_row(label: str, wall: float, phases: dict[str, Any], extra: list[Any]) -> list[Any]:
    named = [phases.get(p) for p in PHASES]
    pack_wall = phases.get("wall_s") or 0.0
    # persist_s runs on the writer thread beside the others: not part of the training thread's wall time.
    on_thread = sum(v or 0.0 for p, v in zip(PHASES, named, strict=True) if p != "persist_s")
    other = round(pack_wall - on_thread, 2) if pack_wall else None
    return [label, wall, *extra, *(round(v, 2) if isinstance(v, float) else v for v in named), other]


def report(args: argparse.Namespace, tasks: list[dict[str, Any]], alone: dict[str, Any]) -> None:
    headers = ["run", "wall s", "x engine", "GPU busy %", "first step s", *(p[:-2] for p in PHASES), "other"]
    rows = []
    for i, task in enumerate(tasks):
        first = task["packs"][0]["profile"] if task["packs"] else {}
        rows.append(phase_row(f"task {i + 1} ({task['policy']}, {len(task['packs'])} packs)", task["wall_s"],
                              task_phases(task["packs"]), [round(task["wall_s"] / alone["wall_s"], 2),
                                                           task["gpu_busy_pct"], first.get("first_step_s")]))
    rows.append(phase_row("engine alone", alone["wall_s"], alone["phases"], [1.0, None, None]))
    print_table(headers, rows)
    no_exit = [t for t in tasks[1:] if t["policy"] == "none"] or tasks[:1]
    exits = [t for t in tasks if t["policy"] != "none"]
    ratios = {"warm_no_exit_over_engine": round(no_exit[0]["wall_s"] / alone["wall_s"], 3),
              "cold_first_task_over_engine": round(tasks[0]["wall_s"] / alone["wall_s"], 3)}
    if exits:
        ratios["early_exit_over_warm_no_exit"] = round(exits[0]["wall_s"] / no_exit[0]["wall_s"], 3)
    print(json.dumps(ratios), flush=True)
    model = args.shape or args.model
    device = "gpu" if torch.cuda.is_available() else "cpu"
    out = args.out / f"service_speed-{model}-{device}-{datetime.now(UTC):%Y%m%d-%H%M}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "service_speed", "model": model, "dataset": args.dataset,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_description(),
        "commit": git_commit(), "command": command_line(), "ratios": ratios, "tasks": tasks,
        "engine_alone": alone, "table": {"headers": headers, "rows": rows},
    }, indent=1) + "\n")  # fmt: skip
    print(f"written to {out}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
