"""Sampling throughput under many adapters (issue 35): the sampler's engine (worker/engine/sampling.py: every request
of a batch under its own adapter in one forward per token, the grouped LoRA path, a KV cache) against PEFT.

For 1, 8 and 32 concurrent requests spread over 8 adapters (rank 16 on every projection), each request a prompt of
`--prompt-tokens` random tokens and exactly `--new-tokens` new ones (no stop token), greedy:

- engine: all requests in one `sample` call, as the sampler decodes a batch;
- PEFT per adapter (the strongest plain baseline, the issue's): one PeftModel holding the 8 adapters, each adapter's
  requests batched in one `generate` after `set_adapter`, the adapters one after another;
- PEFT mixed batch: the same PeftModel's own multi-adapter inference, one `generate` with `adapter_names`;
- base alone: the same requests through the bare model, no adapter (the ceiling).

Random weights of a real shape (benchmarks/base_models.py), built on the device: throughput does not depend on the
weights' values. Prints a table and writes benchmarks/results/sampling-<shape>-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.base_models import SHAPES, build, projections
from benchmarks.common import print_table, write_result
from worker.engine.lora import LoraConfig
from worker.engine.sampling import Adapter, SampleJob, sample

ADAPTERS = 8
RANK = 16


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(run: Callable[[], None], repeats: int) -> float:
    """Seconds of one run: the best of ``repeats`` after a warm-up run."""
    run()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def peft_model(shape: str, device: torch.device) -> Any:
    """A PeftModel of `shape` with ADAPTERS random adapters (B not zero, so each adapter changes the output)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=projections(shape), lora_dropout=0.0,
                            init_lora_weights=False)
    model = get_peft_model(build(shape, device), config, adapter_name="a0")
    for i in range(1, ADAPTERS):
        model.add_adapter(f"a{i}", config)
    model.eval()
    return model


def engine_adapters(peft: Any) -> list[Adapter]:
    """The PeftModel's adapters as the sampler holds them: the very same weights."""
    adapters = []
    for i in range(ADAPTERS):
        name, tensors = f"a{i}", {}
        for path, module in peft.named_modules():
            if hasattr(module, "lora_A") and name in getattr(module, "lora_A", {}):
                key = path.removeprefix("base_model.model.")
                tensors[key] = (module.lora_A[name].weight.detach(), module.lora_B[name].weight.detach())
        adapters.append(Adapter(name, LoraConfig(rank=RANK, alpha=2 * RANK, dropout=0.0), tensors))
    return adapters


@dataclass(frozen=True)
class Models:
    """The bare model (the engine's and the base's), the PeftModel of the same shape, and its adapters as the
    engine holds them."""

    bare: Any
    peft: Any
    adapters: list[Adapter]


def runs(models: Models, prompts: torch.Tensor, new_tokens: int) -> dict[str, Callable[[], None]]:
    """Each method decoding every prompt (request i under adapter i mod ADAPTERS) to exactly `new_tokens`."""
    n, prompt_tokens = prompts.shape
    owners = [i % ADAPTERS for i in range(n)]
    device = prompts.device

    def engine() -> None:
        jobs = [SampleJob(p.tolist(), models.adapters[a], max_tokens=new_tokens)
                for p, a in zip(prompts, owners, strict=True)]
        sample(models.bare, jobs, stop_ids=frozenset(), pad_token_id=0)
        assert all(len(j.tokens) == new_tokens for j in jobs)

    def generate(model: Any, ids: torch.Tensor, **kwargs: Any) -> None:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)
        assert out.shape[1] == prompt_tokens + new_tokens

    def peft_per_adapter() -> None:
        for a in sorted(set(owners)):
            models.peft.set_adapter(f"a{a}")
            generate(models.peft, prompts[torch.tensor([i for i, o in enumerate(owners) if o == a], device=device)])

    def peft_mixed() -> None:
        generate(models.peft, prompts, adapter_names=[f"a{o}" for o in owners])

    def base_alone() -> None:
        generate(models.bare, prompts)

    return {"engine": engine, "peft": peft_per_adapter, "mixed": peft_mixed, "base": base_alone}


def measure(shape: str, device: torch.device, requests: list[int], prompt_tokens: int, new_tokens: int,
            repeats: int) -> list[list[Any]]:
    peft = peft_model(shape, device)
    models = Models(build(shape, device), peft, engine_adapters(peft))
    vocab = int(SHAPES[shape]["vocab_size"])
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in requests:
        prompts = torch.randint(1, vocab, (n, prompt_tokens), generator=generator).to(device)
        seconds = {}
        with torch.no_grad():
            for name, run in runs(models, prompts, new_tokens).items():
                seconds[name] = timed(run, repeats)
                print(f"{shape}: {n} requests, {name}: {seconds[name]:.3f} s", flush=True)
        rate = {k: n * new_tokens / v for k, v in seconds.items()}
        rows.append([n, min(n, ADAPTERS), round(rate["engine"]), round(rate["peft"]), round(rate["mixed"]),
                     round(rate["base"]), round(rate["engine"] / rate["peft"], 2),
                     round(rate["engine"] / rate["mixed"], 2), round(rate["engine"] / rate["base"], 2)])
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    headers = ["requests", "adapters", "engine tok/s", "PEFT per adapter tok/s", "PEFT mixed batch tok/s",
               "base alone tok/s", "engine/PEFT per adapter", "engine/PEFT mixed", "engine/base"]
    rows = measure(args.shape, device, args.requests, args.prompt_tokens, args.new_tokens, args.repeats)
    print_table(headers, rows)
    write_result(f"sampling-{args.shape}", headers, rows, {
        "shape": args.shape, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "adapters": ADAPTERS, "rank": RANK, "targets": projections(args.shape), "repeats": args.repeats,
        "what": "new tokens per second over all requests, greedy, every request exactly new_tokens long, the best "
                "of `repeats` runs after a warm-up; requests spread over the adapters round-robin",
        "baselines": "PEFT per adapter: one PeftModel with the 8 adapters, each adapter's requests in one generate "
                     "after set_adapter, adapter after adapter (the issue's baseline); PEFT mixed batch: its "
                     "adapter_names multi-adapter generate; base alone: the bare model, no adapter"})


if __name__ == "__main__":
    main()
