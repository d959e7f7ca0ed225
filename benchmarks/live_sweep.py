"""Issue 6's live run: the sweep of `benchmarks.sweep`, submitted through the running service with early exit.

    python -m benchmarks.live_sweep --data .sweepdata --datasets trivia arithmetic --policy alto
    python -m benchmarks.live_sweep --data .sweepdata --datasets arithmetic --model tiny-random-llama \\
        --max-seq-len 512 --rows 64 16 16 --epochs 1                          # a CPU smoke run

It starts the whole service (`loraplane up`, the embedded default: SQLite, file-backed bus and broker) in a
fresh LORAPLANE_HOME with one worker per dataset (so the datasets' tasks run side by side, as the two full
sweeps did on the same GPU), then, through the Python client, as a user would: a tenant and an API key,
the training and validation files uploaded, one task per dataset with the same grid as the full sweep
(learning rate {1e-4, 3e-4, 1e-3, 3e-3} x rank {4, 16} x batch size {4, 8, 16}, alpha 2 x rank, dropout
0.05, all linear layers, one epoch, constant learning rate) and `early_exit: {"policy": POLICY}`. It waits
for the tasks, then scores the best adapter (downloaded in PEFT format, as a user gets it) on the held-out
test rows exactly as `benchmarks.sweep` scores its trials (greedy decoding reproduces an accepted answer).

Writes `benchmarks/results/sweeps/<dataset>-<model>-live-<policy>.json`: wall-clock from submission to the
task's end, samples trained (sum of steps done x batch size over the trials), each trial's state, steps
and stop reason, the best trial and its test accuracy, device, date and command; on a GPU also its
utilisation sampled through NVML every half second from submission to the last task's end, and every pack's
profile as the worker measured it (step time, tokens, and its phases: training steps, validation, checkpoint
snapshots and their writing, exports, the end's wait for the writer, and the share of its wall time outside training
steps; its steps' seconds split into
waiting for the device, building batches on the critical path, and other host work).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.common import RESULTS, command_line, device_description, git_commit, print_table
from benchmarks.sweep import BATCHES, LRS, MODELS, RANKS, read, test_accuracy
from loraplane.client import Client
from worker.engine import PackEngine, TrialSpec, load_base_model
from worker.engine.export import read_peft_adapter

# "all-linear" in the engine (benchmarks.sweep's trials); the API names the layers.
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL_KEYS = {"smollm2-135m-instruct": "smollm2", "tiny-random-llama": "tiny"}


def start_service(home: Path, port: int, admin_token: str, workers: int, slots: int,
                  worker_args: Sequence[str] = ()) -> list[subprocess.Popen[bytes]]:
    """`loraplane up` (the embedded default) with its worker, and ``workers - 1`` more workers once it answers.
    With ``worker_args``, `up` runs no worker and one `loraplane worker <worker_args>` joins instead (a worker over
    several GPUs: ``["--gpus", "0,1"]``)."""
    env = {**os.environ, "LORAPLANE_HOME": str(home), "LORAPLANE_ADMIN_TOKEN": admin_token,
           "LORAPLANE_WORKER_MAX_SLOTS": str(slots), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = (home / "service.log").open("ab")
    up = ["--no-worker"] if worker_args else ["--worker-id", "live-1"]
    procs = [subprocess.Popen([sys.executable, "-m", "loraplane.cli", "up", "--port", str(port), *up],
                              env=env, stdout=log, stderr=log, start_new_session=True)]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:  # the extra workers join once the database exists (`up` migrates it first)
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise SystemExit(f"the service did not come up; see {home / 'service.log'}")
        time.sleep(1)
    if worker_args:
        procs.append(subprocess.Popen([sys.executable, "-m", "loraplane.cli", "worker", *worker_args],
                                      env=env, stdout=log, stderr=log, start_new_session=True))
    for i in range(2, workers + 1):
        procs.append(subprocess.Popen([sys.executable, "-m", "loraplane.cli", "worker", "--worker-id", f"live-{i}"],
                                      env=env, stdout=log, stderr=log, start_new_session=True))
    return procs


def stop_service(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def task_spec(model: str, train_id: str, val_id: str, epochs: int, max_seq_len: int, policy: str,
              eval_interval: int, checkpoints: bool = True) -> dict[str, Any]:
    return {
        "base_model": model, "training_file": train_id, "validation_file": val_id,
        "search_space": {"learning_rate": list(LRS), "lora_rank": list(RANKS), "batch_size": list(BATCHES),
                         "lora_dropout": [0.05], "target_modules": [ALL_LINEAR]},
        "strategy": "grid", "epochs": epochs, "max_seq_len": max_seq_len, "eval_interval": eval_interval,
        "early_exit": {"policy": policy}, "seed": 0, "training": {"checkpoints": checkpoints},
        "scheduling": {"max_trials_per_pack": len(LRS) * len(RANKS) * len(BATCHES)},
    }  # fmt: skip


def best_adapter_accuracy(model_key: str, adapter_dir: Path, test: list[dict[str, Any]], max_seq_len: int) -> float:
    """The downloaded PEFT adapter, loaded into a one-slot pack, scored as benchmarks.sweep scores its trials."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_base_model(MODELS[model_key], cache_dir=Path(tempfile.gettempdir()) / "loraplane-models",
                                       device=device)
    config, tensors = read_peft_adapter(adapter_dir)
    engine = PackEngine(model, tokenizer, capacity=1, max_rank=config.rank, device=device)
    spec = TrialSpec(trial_id="best", learning_rate=1e-4, lora_rank=config.rank, lora_alpha=config.alpha,
                     lora_dropout=0.0, batch_size=1, target_modules=["all-linear"], seed=0, max_steps=1,
                     eval_interval=1, max_seq_len=max_seq_len, train_rows=[{"messages": test[0]["messages"]}],
                     val_rows=[])
    slot = engine.admit(spec)
    engine.store.load_slot(slot, {k: (a.to(device), b.to(device)) for k, (a, b) in tensors.items()},
                           rank=config.rank, scale=engine.state(slot).config.scale)
    accuracy = test_accuracy(engine, slot, test, max_seq_len)
    engine.close()
    return accuracy


class GpuBusy:
    """Samples the GPU's utilisation (NVML: the share of time a kernel ran) every ``every_s`` in a thread."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread: threading.Thread | None = None

    def start(self) -> GpuBusy:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # no NVIDIA GPU or no NVML: nothing to sample
            print(f"no GPU utilisation samples ({exc})", flush=True)
            return self
        t0 = time.monotonic()

        def run() -> None:
            while not self._stop.wait(self._every_s):
                self.samples.append((round(time.monotonic() - t0, 1), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any] | None:
        self._stop.set()
        if self._thread is None or not self.samples:
            return None
        self._thread.join()
        busy = [u for _, u in self.samples]
        first = next(i for i, u in enumerate(busy) if u > 0) if any(busy) else len(busy)
        training = busy[first:]  # from the first kernel on (the model's load and the first plan come before)
        return {"mean_pct": round(sum(busy) / len(busy), 1),
                "mean_pct_from_first_kernel": round(sum(training) / len(training), 1) if training else None,
                "samples": self.samples}


def pack_profiles(home: Path) -> list[dict[str, Any]]:
    """Every pack's profile from the service's embedded database (its step and phase measurements)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from common.db import make_engine
    from common.tables import Pack

    with Session(make_engine(f"sqlite:///{(home / 'loraplane.db').resolve()}")) as session:
        packs = session.scalars(select(Pack).order_by(Pack.created_at)).all()
        return [{"pack_id": p.id, "worker_id": p.worker_id, "trials": len(p.trial_ids), "trial_ids": list(p.trial_ids),
                 "state": p.state,
                 "started_at": p.started_at.isoformat() if p.started_at else None,
                 "finished_at": p.finished_at.isoformat() if p.finished_at else None,
                 "profile": {k: v for k, v in (p.profile or {}).items() if k != "samples"}} for p in packs]


def _label(hp: dict[str, Any]) -> str:
    return f"lr{hp['learning_rate']:g}-r{hp['lora_rank']}-b{hp['batch_size']}"


Splits = tuple[list[dict[str, Any]], ...]  # a dataset's train, validation and test rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True, help="the folder benchmarks.sweep_data wrote")
    parser.add_argument("--datasets", nargs="+", choices=["trivia", "arithmetic"], default=["trivia", "arithmetic"])
    parser.add_argument("--model", choices=sorted(MODEL_KEYS), default="smollm2-135m-instruct")
    parser.add_argument("--policy", choices=["alto", "asha", "none"], default="alto")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-seq-len", type=int, default=96)
    parser.add_argument("--eval-interval", type=int, default=25, help="the task's; the sweep's batch-4 trials'")
    parser.add_argument("--rows", type=int, nargs=3, metavar=("TRAIN", "VAL", "TEST"))
    parser.add_argument("--home", type=Path, help="the service's LORAPLANE_HOME (default: a fresh temporary one)")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=RESULTS / "sweeps")
    parser.add_argument("--checkpoints", choices=["on", "off"], default="on",
                        help="the task's training.checkpoints (each trial's kept adapters; on by default)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="loraplane-live-"))
    home.mkdir(parents=True, exist_ok=True)
    admin_token = "lpadmin_" + secrets.token_urlsafe(16)
    trials_per_task = len(LRS) * len(RANKS) * len(BATCHES)
    procs = start_service(home, args.port, admin_token, workers=len(args.datasets), slots=trials_per_task)
    base = f"http://127.0.0.1:{args.port}"
    try:
        lp = Client(base, tenant_key(base, admin_token, trials_per_task), timeout=60)
        data: dict[str, Splits] = {}
        submitted: dict[str, tuple[str, float]] = {}  # dataset -> its task's id, and when it was submitted
        gpu = GpuBusy().start()
        for name in args.datasets:
            data[name], submitted[name] = submit(lp, args, name)
            print(f"{name}: task {submitted[name][0]} submitted", flush=True)
        finished = wait_for_tasks(lp, submitted, args.timeout)
        gpu_busy = gpu.stop()
        if len(finished) < len(submitted):
            late = sorted(set(submitted) - set(finished))
            raise SystemExit(f"tasks not finished within {args.timeout:.0f} s: {late}")
        packs = pack_profiles(home)
        print_packs(packs, gpu_busy)

        args.out.mkdir(parents=True, exist_ok=True)
        for name, (task_id, _t0) in submitted.items():
            write_task_results(lp, args, home, name, task_id, data[name], finished[name], len(submitted), gpu_busy,
                               packs)  # fmt: skip
        lp.close()
    finally:
        stop_service(procs)


def tenant_key(base: str, admin_token: str, trials_per_task: int) -> str:
    """The API key of a new tenant for the run, with room for two tasks' trials at once."""
    with Client(base, admin_token=admin_token, timeout=30) as operator:
        tenant = operator.admin.create_tenant("live-sweep", max_concurrent_trials=2 * trials_per_task)
        key = operator.admin.create_api_key(tenant.id, name="live-sweep").key
    assert key is not None
    return key


def submit(lp: Client, args: argparse.Namespace, name: str) -> tuple[Splits, tuple[str, float]]:
    """Uploads the dataset's training and validation rows and submits its task: the dataset's rows, and the
    task's id and when it was submitted."""
    splits = tuple(read(args.data / name / f"{split}.jsonl") for split in ("train", "val", "test"))
    if args.rows:
        splits = tuple(rows[:n] for rows, n in zip(splits, args.rows, strict=True))
    # The service takes chat rows; the test rows' extra accepted answers stay here.
    files = [lp.files.upload(b"".join(json.dumps({"messages": r["messages"]}).encode() + b"\n" for r in rows),
                             filename=f"{name}-{split}.jsonl").id
             for rows, split in zip(splits[:2], ("train", "val"), strict=True)]
    spec = task_spec(args.model, files[0], files[1], args.epochs, args.max_seq_len, args.policy, args.eval_interval,
                     checkpoints=args.checkpoints == "on")
    return splits, (lp.tasks.create(spec).id, time.monotonic())


def wait_for_tasks(lp: Client, submitted: dict[str, tuple[str, float]], timeout: float) -> dict[str, float]:
    """Polls the tasks until all are done or ``timeout`` passed: each done one's seconds from its submission."""
    finished: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(finished) < len(submitted) and time.monotonic() < deadline:
        for name, (task_id, t0) in submitted.items():
            task = lp.tasks.get(task_id)
            if task.done and name not in finished:
                finished[name] = time.monotonic() - t0
                print(f"{name}: task {task.state} after {finished[name]:.0f} s", flush=True)
        time.sleep(2)
    return finished


def print_packs(packs: list[dict[str, Any]], gpu_busy: dict[str, Any] | None) -> None:
    for pack in packs:
        phases = pack["profile"].get("phases", {})
        print(f"pack {pack['pack_id'][:8]}: {pack['trials']} trials, {pack['profile'].get('steps')} steps, "
              f"{phases.get('wall_s')} s, outside training steps {phases.get('outside_steps_frac')}, "
              f"steps' seconds {pack['profile'].get('step_breakdown_s')}", flush=True)
    if gpu_busy is not None:
        print(f"GPU busy {gpu_busy['mean_pct']}% over the run, {gpu_busy['mean_pct_from_first_kernel']}% from "
              "the first kernel on", flush=True)


def write_task_results(lp: Client, args: argparse.Namespace, home: Path, name: str, task_id: str, data: Splits,
                       wall_s: float, side_by_side: int, gpu_busy: dict[str, Any] | None,
                       packs: list[dict[str, Any]]) -> None:
    """Scores the task's best adapter on the dataset's test rows; writes the task's summary, event log and
    curves, and prints its trials."""
    task = lp.tasks.get(task_id)
    trials = lp.tasks.trials(task_id).data
    adapter = lp.tasks.download_adapter(task_id, home / f"{name}-best-adapter")
    best = task.best_trial
    accuracy = best_adapter_accuracy(MODEL_KEYS[args.model], adapter, data[2], args.max_seq_len)
    rows = [{"trial_id": t.id, "hyperparameters": t.hyperparameters, "state": t.state,
             "stop_reason": t.stop_reason, "steps_done": t.steps_done, "total_steps": t.total_steps,
             "best_val_loss": t.best_val_loss} for t in sorted(trials, key=lambda t: t.index)]
    trained = sum(t.steps_done * int(t.hyperparameters["batch_size"]) for t in trials)
    full = sum(t.total_steps * int(t.hyperparameters["batch_size"]) for t in trials)
    summary = {
        "benchmark": "live_sweep", "dataset": name, "model": args.model, "policy": args.policy,
        "checkpoints": args.checkpoints,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_description(),
        "command": command_line(), "commit": git_commit(), "task_state": task.state,
        "tasks_side_by_side": side_by_side, "train_rows": len(data[0]),
        "wall_s": round(wall_s, 1), "samples_trained": trained, "samples_full": full,
        "samples_saved_frac": round(1 - trained / full, 4) if full else None,
        "best_trial": best.id if best else None,
        "best_hyperparameters": best.hyperparameters if best else None,
        "best_val_loss": best.best_val_loss if best else None, "best_test_accuracy": accuracy,
        "gpu_busy": gpu_busy, "packs": packs, "trials": rows,
    }  # fmt: skip
    stem = f"{name}-{'smollm2' if args.model.startswith('smollm2') else 'tiny'}-live-{args.policy}"
    if args.rows:
        stem += f"-{args.rows[0]}rows"
    if args.checkpoints == "off":
        stem += "-checkpoints-off"
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    events = task_events(lp, task_id)
    (args.out / f"{stem}-events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (args.out / f"{stem}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lp.tasks.curves(task_id)))
    print_table(["trial", "state", "reason", "steps", "of", "best val loss"],
                [[_label(t.hyperparameters), t.state, t.stop_reason or "-", t.steps_done, t.total_steps,
                  t.best_val_loss] for t in sorted(trials, key=lambda t: t.index)])
    print(f"{name}: {task.state} in {wall_s:.0f} s, samples saved "
          f"{summary['samples_saved_frac']}, best {summary['best_hyperparameters']} "
          f"(val loss {summary['best_val_loss']}, test accuracy {accuracy}); written to {args.out / stem}.json",
          flush=True)


def task_events(lp: Client, task_id: str) -> list[dict[str, Any]]:
    """The task's whole event log: where each trial ran, paused, resumed, stopped and why."""
    events, after = [], None
    while True:
        page = lp.tasks.events(task_id, after=after, limit=500)
        events += [{"id": e.id, "at": e.created_at.isoformat(), "type": e.type, "trial_id": e.trial_id,
                    "message": e.message} for e in page.data]
        if not page.has_more:
            break
        after = page.next_after
    return events


if __name__ == "__main__":
    main()
