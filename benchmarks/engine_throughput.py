"""The batched engine against PEFT one adapter at a time and against the frozen base model's own
forward+backward on the same pooled batch (the ceiling), measured side by side in one run (issue 3).

32 trials, ranks 16/32/64 in thirds, all seven projections, per-trial batch 1, 2 and 4, rows of
variable length (real prompt/completion shape: loss on the completion only), random weights in a real
architecture's shape (throughput does not depend on weight values).

    python -m benchmarks.engine_throughput --shape llama-3.2-1b --batch 1 2 4      # on a GPU
    python -m benchmarks.engine_throughput --shape tiny --trials 4 --batch 1 --steps 2 --seq-len 64   # smoke

``--backends torch triton`` measures the engine once per LoRA backend (issue 4: the Triton kernels against
the torch path) in the same run; the ratio columns are those of the last backend. ``--profile`` breaks the
device time of a few steps of the last backend and of the frozen ceiling down by kernel family, beside the
device-busy and wall time per step (where the time goes; ``benchmarks.profiling``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.base_models import SHAPES, load, make_rows, materialise, projections
from benchmarks.common import device_description, git_commit, print_table, write_result
from benchmarks.profiling import breakdown, side_by_side
from kernels import set_backend
from worker.engine import TrialSpec, restore_base_model
from worker.engine.data import Example, collate, encode_rows
from worker.engine.passes import CUDA_WIDTH_MULTIPLE

RANKS = (16, 32, 64)


def trial_specs(k: int, batch: int, seq_len: int, rows: list[dict[str, str]], dropout: float,
                targets: list[str]) -> list[TrialSpec]:
    return [
        TrialSpec(trial_id=f"t{i}", learning_rate=1e-4 * (1 + i % 4), lora_rank=RANKS[i * len(RANKS) // k],
                  lora_alpha=2.0 * RANKS[i * len(RANKS) // k], lora_dropout=dropout, batch_size=batch,
                  target_modules=targets, seed=i, max_steps=10**6, max_seq_len=seq_len,
                  eval_interval=10**9, train_rows=rows, val_rows=[])
        for i in range(k)
    ]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step: Callable[[], int], warmup: int, steps: int) -> float:
    """Tokens per second of `step` (which returns the real tokens it trained on)."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(steps))
    sync()
    return tokens / (time.perf_counter() - t0)


def batches(examples: list[Example], k: int, batch: int, seed: int, pad_id: int) -> Callable[[], Any]:
    """Pooled batches of k x batch examples drawn at random (the engine draws per trial, alike), padded
    like the engine pads them (widths rounded up on CUDA)."""
    rng = random.Random(seed)
    multiple = CUDA_WIDTH_MULTIPLE if torch.cuda.is_available() else 1

    def draw() -> Any:
        return collate([examples[rng.randrange(len(examples))] for _ in range(k * batch)], pad_id, multiple)

    return draw


def real_tokens(batch: Any) -> int:
    return int(batch.attention_mask.sum())


def frozen_step(model: Any, draw: Callable[[], Any], device: torch.device,
                recompute: bool) -> Callable[[], int]:
    """The frozen model's forward+backward on a pooled batch: no LoRA, no weight gradients, the same
    target-only chunked loss as the engine; the backward runs through every layer to the embeddings.
    With `recompute`, decoder layers are checkpointed exactly as the engine's are."""
    from worker.engine.lora import LoraContext
    from worker.engine.loss import target_token_loss  # the engine's own loss, so only LoRA differs
    from worker.engine.recompute import enable_recompute

    if recompute:
        enable_recompute(model, LoraContext())
    embed = model.get_input_embeddings()

    def step() -> int:
        batch = draw().to(device)
        inputs = embed(batch.input_ids).detach().requires_grad_()
        hidden = model.base_model(inputs_embeds=inputs, attention_mask=batch.attention_mask,
                                  use_cache=False).last_hidden_state
        loss = target_token_loss(hidden, batch.labels, model.get_output_embeddings())
        loss.backward()
        return real_tokens(batch)

    return step


def peft_steps(model: Any, specs: list[TrialSpec], examples: list[Example], pad_id: int,
               device: torch.device) -> Callable[[], int]:
    """PEFT with one adapter per trial, trained one at a time (set_adapter, forward, backward, AdamW)."""
    from peft import LoraConfig, get_peft_model

    def config(spec: TrialSpec) -> LoraConfig:
        return LoraConfig(r=spec.lora_rank, lora_alpha=int(spec.lora_alpha), lora_dropout=spec.lora_dropout,
                          target_modules=spec.target_modules, task_type="CAUSAL_LM")

    peft_model = get_peft_model(model, config(specs[0]), adapter_name=specs[0].trial_id)
    for spec in specs[1:]:
        peft_model.add_adapter(spec.trial_id, config(spec))
    optimizers = {}
    for spec in specs:
        params = [p for n, p in peft_model.named_parameters() if f".{spec.trial_id}." in n]
        optimizers[spec.trial_id] = torch.optim.AdamW(params, lr=spec.learning_rate)
    draws = {s.trial_id: batches(examples, 1, s.batch_size, i, pad_id) for i, s in enumerate(specs)}
    turn = iter(range(10**9))

    def step() -> int:
        spec = specs[next(turn) % len(specs)]
        peft_model.set_adapter(spec.trial_id)
        batch = draws[spec.trial_id]().to(device)
        out = peft_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        out.loss.backward()
        optimizers[spec.trial_id].step()
        optimizers[spec.trial_id].zero_grad(set_to_none=True)
        return real_tokens(batch)

    return step


def peft_one_adapter(model: Any, rank: int, batch: int, examples: list[Example], pad_id: int,
                     device: torch.device, warmup: int, steps: int, targets: list[str]) -> float | str:
    """What a careful user runs for one trial: one PeftModel with one adapter (bf16 base, SDPA attention,
    fused AdamW), the trial's own batch padded to its longest row (as transformers' collator pads), loss on
    the completion. Tokens/s of that one trial; the model is unwrapped again afterwards."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  target_modules=targets, task_type="CAUSAL_LM"))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    rng = random.Random(rank)

    def step() -> int:
        rows = collate([examples[rng.randrange(len(examples))] for _ in range(batch)], pad_id, 1).to(device)
        out = peft_model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, labels=rows.labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return real_tokens(rows)

    try:
        return measure(lambda: step, warmup, steps)
    finally:
        peft_model.unload()  # the bare model again, for the next rank


def peft_strong(model: Any, specs: list[TrialSpec], examples: list[Example], pad_id: int, device: torch.device,
                warmup: int, steps: int) -> float | str:
    """The trials' mix trained one after another, each as `peft_one_adapter`: every trial trains the same
    tokens, so the mix's rate is the trial-weighted harmonic mean of the per-rank rates."""
    counts: dict[int, int] = {}
    for spec in specs:
        counts[spec.lora_rank] = counts.get(spec.lora_rank, 0) + 1
    batch = specs[0].batch_size
    targets = specs[0].target_modules
    rates = {r: peft_one_adapter(model, r, batch, examples, pad_id, device, warmup, steps, targets) for r in counts}
    if any(not isinstance(v, float) for v in rates.values()):
        return "OOM"
    return sum(counts.values()) / sum(n / float(rates[r]) for r, n in counts.items())


def engine_steps(model: Any, tokenizer: Any, specs: list[TrialSpec], device: torch.device,
                 recompute: bool) -> tuple[Callable[[], int], Any]:
    from worker.engine import PackEngine

    engine = PackEngine(model, tokenizer, capacity=len(specs), device=device, max_rank=max(RANKS),
                        target_modules=specs[0].target_modules, activation_checkpointing=recompute)
    for spec in specs:
        engine.admit(spec)

    def step() -> int:
        engine.step()
        assert engine.last_stats is not None
        return int(engine.last_stats.tokens)

    return step, engine


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(make: Callable[[], Callable[[], int]], warmup: int, steps: int) -> float | str:
    """Tokens/s of the step `make` builds, or "OOM" when the device runs out of memory."""
    try:
        return timed(make(), warmup, steps)
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    finally:
        free()


def run_batch(args: argparse.Namespace, batch: int, base: Path, tokenizer: Any, rows: list[dict[str, str]],
              examples: list[Example], device: torch.device) -> list[Any]:
    """One table row: PEFT one at a time, the engine and the frozen ceiling at one per-trial batch."""
    pad_id = int(tokenizer.pad_token_id)
    specs = trial_specs(args.trials, batch, args.seq_len, rows, args.dropout, projections(args.shape))
    model = load(base, device)
    # Counted on the bare model: once PEFT has wrapped it, its adapters' nn.Linear modules would count too.
    flops_per_token = 4 * linear_params(model) + 6 * model.config.num_hidden_layers * model.config.hidden_size * (
        sum(len(e.input_ids) for e in examples) / len(examples))
    engines: list[Any] = []

    def make_engine() -> Callable[[], int]:
        step, engine = engine_steps(model, tokenizer, specs, device, args.activation_checkpointing)
        engines.append(engine)
        return step

    by_backend: dict[str, float | str] = {}
    stats = None
    for backend in args.backends:
        set_backend(backend)
        by_backend[backend] = measure(make_engine, args.warmup, args.steps)
        stats = engines[0].last_stats if engines and engines[0].last_stats else None
        graphs = engines[0].graphs if engines else None
        if graphs is not None:  # steps replayed from CUDA graphs (worker/engine/capture.py)
            print(f"engine[{backend}] b{batch}: {graphs.captures} graphs captured, {graphs.replays} steps replayed")
        if args.profile and backend == args.backends[-1] and engines:
            profiles[f"engine[{backend}] b{batch}"] = breakdown(engine_step(engines[0]))
        while engines:  # (a loop variable would keep the last engine, and its ~20 GiB, alive)
            engines.pop().close()  # unwraps the model for the next backend and the PEFT run
        free()  # the engine's adapter store and optimizer state, before PEFT allocates its own
    for variant in args.variants:  # what each setting is worth: the last backend under it
        settings = dict(item.split("=", 1) for item in variant.split(","))
        os.environ.update(settings)
        try:
            rate = measure(make_engine, args.warmup, args.steps)
        finally:
            for name in settings:
                os.environ.pop(name)
            while engines:
                engines.pop().close()
            free()
        variant_rows.append([batch, variant, num(rate), ratio(rate, by_backend[args.backends[-1]], 3)])
    set_backend("auto")
    engine = by_backend[args.backends[-1]]
    pooled = batches(examples, args.trials, batch, 1, pad_id)
    frozen_made: list[Callable[[], int]] = []

    def make_frozen() -> Callable[[], int]:
        frozen_made.append(frozen_step(model, pooled, device, args.activation_checkpointing))
        return frozen_made[-1]

    frozen = measure(make_frozen, args.warmup, args.steps)
    if args.profile and frozen_made and isinstance(frozen, float):
        profiles[f"frozen b{batch}"] = breakdown(frozen_made[0])
    frozen_made.clear()
    restore_base_model(model)  # PEFT below trains without recompute, as its users run it
    peft: float | str = "-"
    peft_multi: float | str = "-"
    if not args.skip_peft:
        # The strong baseline first: the multi-adapter variant below leaves its adapters in the model.
        peft = peft_strong(model, specs, examples, pad_id, device, args.warmup, args.peft_steps * args.trials)
        peft_multi = measure(lambda: peft_steps(model, specs, examples, pad_id, device), args.warmup,
                             args.peft_steps * args.trials)

    mfu = None
    if args.matmul_tflops and isinstance(engine, float):
        mfu = round(engine * flops_per_token / 1e12 / args.matmul_tflops, 3)
        mfu_rows.append([batch, round(engine * flops_per_token / 1e12, 1), args.matmul_tflops, mfu])
    profiled = profiles.get(f"engine[{args.backends[-1]}] b{batch}")
    busy = (round(profiled["device_busy_ms_per_step"] / profiled["wall_ms_per_step"], 3)
            if profiled and profiled["wall_ms_per_step"] else None)
    summary.append({"shape": args.shape, "trials": args.trials, "batch": batch, "engine_tok_s": num(engine),
                    "frozen_tok_s": num(frozen), "peft_tok_s": num(peft), "peft_multi_adapter_tok_s": num(peft_multi),
                    "engine_over_frozen": ratio(engine, frozen), "engine_over_peft": ratio(engine, peft),
                    "mfu": mfu, "gpu_busy_frac": busy, "device": device_description(), "commit": git_commit()})
    peak = stats.peak_memory_bytes / 2**30 if stats and stats.peak_memory_bytes else float("nan")
    padding = stats.padded_fraction if stats else float("nan")
    return [batch, args.trials, num(peft), num(peft_multi), *[num(by_backend[b]) for b in args.backends],
            num(frozen), ratio(engine, peft), ratio(engine, frozen), round(padding, 3), round(peak, 1)]


def num(v: float | str) -> Any:
    return round(v) if isinstance(v, float) else v


def ratio(a: float | str, b: float | str, digits: int = 2) -> Any:
    return round(a / b, digits) if isinstance(a, float) and isinstance(b, float) else "-"


variant_rows: list[list[Any]] = []  # --variants: [batch, settings, tok/s, over the defaults]
mfu_rows: list[list[Any]] = []
summary: list[dict[str, Any]] = []  # one row per batch, the fields every engine result carries (issue 15)
profiles: dict[str, dict[str, Any]] = {}  # --profile: "<method> b<batch>" -> benchmarks.profiling.breakdown


def linear_params(model: Any) -> int:
    """Weights of the model's matrix products (every nn.Linear, lm_head included; not the input embedding)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def matmul_tflops() -> float:
    """The bf16 matrix rate of this GPU: an 8192^3 product on random data, median of 20 after warm-up."""
    import triton.testing

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = float(triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median"))
    return round(2 * 8192**3 / ms / 1e9, 1)


def engine_step(engine: Any) -> Callable[[], None]:
    def step() -> None:
        engine.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="measured steps of the engine and the frozen model")
    parser.add_argument("--peft-steps", type=int, default=2, help="measured steps per adapter for PEFT")
    # cuDNN builds an attention plan per sequence width (widths are rounded to 64 on CUDA: 5 of them for rows
    # of 256-512 tokens); a method measured before its widths are warm reads up to 3x low.
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--backends", nargs="+", choices=["auto", "torch", "triton"], default=["auto"],
                        help="LoRA backends of the engine, each measured in this run")
    parser.add_argument("--profile", action="store_true", help="print a profiler table of the last backend")
    parser.add_argument("--mfu", action="store_true",
                        help="also the model FLOP utilisation of the engine against this GPU's measured bf16 rate")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="environment settings to time the last backend under, beside the defaults, each "
                             "NAME=VALUE[,NAME=VALUE]: LORAPLANE_FUSED_OPS=none (each fused op's share), "
                             "LORAPLANE_GROUPED_MM=0 (the padded grid instead of grouped_mm), ...")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute decoder layers in the backward, in the engine and the frozen ceiling alike")
    args = parser.parse_args()
    if len(set(args.backends)) != len(args.backends):
        parser.error("each backend once: the table has one column per backend")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.matmul_tflops = matmul_tflops() if args.mfu and device.type == "cuda" else None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, base = materialise(args.shape, Path(tmp))
        rows = make_rows(512, args.seq_len, seed=0)
        examples = encode_rows(rows, tokenizer, args.seq_len)
        table = []
        for b in args.batch:
            table.append(run_batch(args, b, base, tokenizer, rows, examples, device))
            free()  # the batch's model (and PEFT's wrapping of it) is gone with run_batch
    write_result(
        f"engine_throughput-{args.shape}" + ("-recompute" if args.activation_checkpointing else "")
        + ("" if args.backends == ["auto"] else "-" + "-".join(args.backends)),
        ["batch/trial", "trials", "PEFT 1 adapter tok/s", "PEFT multi-adapter tok/s",
         *[f"engine[{b}] tok/s" for b in args.backends],
         "frozen tok/s", "engine/PEFT", "engine/frozen", "engine padded frac", "engine peak GiB"],
        table,
        {"shape": args.shape, "seq_len": args.seq_len, "ranks": list(RANKS), "targets": projections(args.shape),
         "activation_checkpointing": args.activation_checkpointing,
         "dropout": args.dropout, "steps": args.steps, "warmup": args.warmup, "backends": args.backends,
         "summary": summary,
         "peft": "PEFT 1 adapter: what a careful user runs, one PeftModel with one adapter per trial (bf16, SDPA, "
                 "fused AdamW, its own batch padded to its longest row), trials one after another; ratios are "
                 "against it. PEFT multi-adapter: all trials' adapters in one PeftModel, switched per step "
                 "(a second column only).",
         "tokens": "real (non-pad) tokens per second; rows of 50-100% of seq_len, loss on completions only",
         "mfu": {"headers": ["batch/trial", "engine TFLOP/s", "bf16 matmul TFLOP/s", "MFU"], "rows": mfu_rows,
                 "flops per real token": "4 x (nn.Linear weights of the bare model, lm_head included) + 6 x "
                                         "layers x hidden x mean row length (causal attention, fwd + bwd)"},
         "variants": {"headers": ["batch/trial", "settings", "engine tok/s", "over the defaults"],
                      "rows": variant_rows},
         "profile": {"what": "device ms per step by kernel family (torch.profiler), device-busy and "
                             "synchronised wall ms per step, top kernels", "methods": profiles}},
    )
    if mfu_rows:
        print_table(["batch/trial", "engine TFLOP/s", "bf16 matmul TFLOP/s", "MFU"], mfu_rows)
    if variant_rows:
        print_table(["batch/trial", "settings", "engine tok/s", "over the defaults"], variant_rows)
    if profiles:
        print()
        print_table(*side_by_side(profiles))


if __name__ == "__main__":
    main()
