"""Issue 37: a task trained by a worker over several GPUs, through the whole service, as a user runs it.

    python -m benchmarks.multi_gpu_service --gpus 0,1 --shape llama-3.1-8b          # on a host of two GPUs
    python -m benchmarks.multi_gpu_service --gpus cpu --shape tiny --trials 2        # anywhere: the same journey

It starts the service's API and scheduler (`loraplane up --no-worker`, the embedded default) and one worker over the
GPUs (`loraplane worker --gpus 0,1`: each pack over all of them, the base's layers sharded, the trials dealt to the
ranks); registers a random-weight directory of `--shape` as a model (`benchmarks.base_models.materialise`); and,
through the Python client as a tenant, uploads synthetic rows, submits a grid task and waits for it to succeed. Then
it downloads the best adapter and loads it in PEFT on the registered directory: the adapted model's logits must
differ from the base's (the adapter trained) and be finite. Prints a table (submit -> succeeded, the pack's steps
and tokens/s from its profile, the PEFT check) and writes benchmarks/results/multi_gpu_service-<shape>-<device>-
<date>.json with device, date, commit and command. `--gpus cpu` runs one worker on the CPU (no sharding): a check
of the script, no claim.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.base_models import make_rows, materialise
from benchmarks.common import write_result
from benchmarks.live_sweep import pack_profiles, start_service, stop_service
from loraplane.client import Client


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="0,1", help="the worker's CUDA devices, or 'cpu'")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--trials", type=int, default=4, help="the grid: this many learning rates x ranks 8 and 16")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--port", type=int, default=8437)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--model-dir", type=Path,
                        help="where the random-weight model is written, or found if an earlier run wrote it there")
    return parser.parse_args()


def jsonl(rows: list[dict[str, str]]) -> bytes:
    return b"".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["completion"]}]}).encode() + b"\n"
                    for r in rows)


def peft_check(base_dir: Path, adapter_dir: Path, tokenizer: Any, device: torch.device) -> dict[str, Any]:
    """The adapter loaded in PEFT on the registered base: how far its logits move from the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base: Any = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    base.to(device)
    ids = tokenizer("alpha beta gamma delta", return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        before = base(input_ids=ids).logits.float()
        adapted = PeftModel.from_pretrained(base, str(adapter_dir)).to(device)
        after = adapted(input_ids=ids).logits.float()
    return {"finite": bool(torch.isfinite(after).all()), "max_abs_logit_change": float((after - before).abs().max())}


def main() -> None:
    args = parse_args()
    home = Path(tempfile.mkdtemp(prefix="loraplane-multi-"))
    admin_token = "lpadmin_" + secrets.token_urlsafe(16)
    tokenizer, directory = materialise(args.shape, args.model_dir or home / "model")
    tokenizer.save_pretrained(directory)
    worker = ["--worker-id", "multi", *([] if args.gpus == "cpu" else ["--gpus", args.gpus])]
    procs = start_service(home, args.port, admin_token, workers=1, slots=64, worker_args=worker)
    url = f"http://127.0.0.1:{args.port}"
    lrs = [1e-4 * 2**i for i in range(max(1, args.trials // 2))]
    try:
        name = f"random-{args.shape}"
        with Client(url, admin_token=admin_token, timeout=300) as operator:
            operator.admin.register_model(name, str(directory), description=f"random weights, {args.shape} shape")
            tenant = operator.admin.create_tenant("multi", max_concurrent_trials=64)
            key = operator.admin.create_api_key(tenant.id, name="multi").key
        assert key is not None
        with Client(url, key, timeout=120) as lp:
            train = lp.files.upload(jsonl(make_rows(args.rows, args.seq_len, seed=1)), filename="train.jsonl").id
            val = lp.files.upload(jsonl(make_rows(32, args.seq_len, seed=2)), filename="val.jsonl").id
            submitted = time.monotonic()
            task = lp.tasks.create({
                "base_model": name, "training_file": train, "validation_file": val, "strategy": "grid",
                "search_space": {"learning_rate": lrs, "lora_rank": [8, 16], "batch_size": [args.batch],
                                 "target_modules": ["all-linear"]},
                "epochs": 1, "max_seq_len": args.seq_len, "early_exit": {"policy": "none"}, "seed": 0,
                "scheduling": {"max_trials_per_pack": 2 * len(lrs)},
            })  # fmt: skip
            task = lp.tasks.wait(task.id, timeout=args.timeout)
            wall = time.monotonic() - submitted
            trials = lp.tasks.trials(task.id).data
            print(f"task {task.id}: {task.state} in {wall:.1f} s; trials "
                  f"{[(t.id, t.state, t.steps_done) for t in trials]}", flush=True)
            adapter = lp.tasks.download_adapter(task.id, home / "adapter") if task.state == "succeeded" else None
    finally:
        stop_service(procs)
    packs = [p for p in pack_profiles(home) if p["trials"]]
    device = torch.device("cpu") if args.gpus == "cpu" else torch.device("cuda", 0)
    check = peft_check(directory, adapter, tokenizer, device) if adapter is not None else None
    profile = packs[-1]["profile"] if packs else {}
    rows = [[args.shape, args.gpus, len(trials), sum(t.steps_done for t in trials), task.state, round(wall, 1),
             profile.get("tokens_per_s"), profile.get("steps"), None if check is None else check["finite"],
             None if check is None else f"{check['max_abs_logit_change']:.3g}"]]
    headers = ["shape", "gpus", "trials", "steps", "state", "submit->done s", "pack tokens/s", "pack steps",
               "PEFT loads, finite", "max |logit change|"]
    write_result(f"multi_gpu_service-{args.shape}", headers, rows,
                 {"gpus": args.gpus, "rows": args.rows, "batch": args.batch, "seq_len": args.seq_len,
                  "packs": packs, "peft": check,
                  "trials": [{"id": t.id, "state": t.state, "steps_done": t.steps_done,
                              "hyperparameters": t.hyperparameters} for t in trials]})
    if task.state != "succeeded" or check is None or not check["finite"] or check["max_abs_logit_change"] == 0:
        raise SystemExit(f"the task did not train a usable adapter; see {home / 'service.log'}")


if __name__ == "__main__":
    main()
