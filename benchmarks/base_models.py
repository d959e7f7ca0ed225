"""Base models for the GPU benchmarks: real architectures' shapes with random weights (throughput does not
depend on weight values), saved and loaded back from disk like a real checkpoint, plus synthetic rows."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.architectures import target_modules_for
from common.tiny_tokenizer import TINY_TOKENIZER
from worker.engine import ModelSource, load_base_model
from worker.engine.base_model import base_dtype

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    # SmolLM2-135M's shape (the model of the issue-6 sweeps): 30 narrow layers, where per-step host work shows.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
    # Llama-3.1-70B: more than one GPU holds (issue 20 shards it over several; `--layers` keeps the first L).
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256),
    # Other families (the `model_type` key; Llama where none): Qwen2's q/k/v biases, Phi-3's fused projections,
    # Gemma 2's soft caps (its attention takes the rows path: torch's varlen kernel has no soft cap).
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "phi-3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32064),
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000),
}


def model_type(shape: str) -> str:
    return str(SHAPES[shape].get("model_type", "llama"))


def projections(shape: str) -> list[str]:
    """Every projection of a decoder layer of `shape`'s family: the benchmarks' LoRA targets."""
    return list(target_modules_for(model_type(shape)) or ())


def shape_config(shape: str, layers: int | None = None) -> Any:
    """The transformers config of `shape` (`layers`: only its first L decoder layers)."""
    fields = {k: v for k, v in SHAPES[shape].items() if k != "model_type"}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type(shape), **fields, max_position_embeddings=4096)


def tiny_tokenizer(directory: Path) -> Any:
    """The byte-level tokenizer every shape is benchmarked with (a token a byte), saved under `directory`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _, tokenizer = load_base_model(ModelSource("tiny-random-llama", "tiny-random-llama", tokenizer=TINY_TOKENIZER),
                                   cache_dir=directory, device=torch.device("cpu"))
    return tokenizer


def materialise(shape: str, directory: Path, layers: int | None = None) -> tuple[Any, Path]:
    """(byte-level tokenizer, directory of a random-weight model of `shape`) under `directory`: a checkpoint
    on disk, as a registered model is. The weights are drawn on the GPU where there is one (`build`), in the
    dtype the engine loads them in: drawing 8B parameters on the CPU in fp32 took minutes."""
    tokenizer = tiny_tokenizer(directory)
    base = directory / "base"
    written = base / "materialised"  # the last thing written: a directory without it is half-written
    if written.exists() and written.read_text() == f"{shape} {layers}":
        return tokenizer, base  # an earlier benchmark on this machine wrote it (8B: 16 GB, a minute)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = build(shape, device, layers=layers)
    model.save_pretrained(base)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    written.write_text(f"{shape} {layers}")
    return tokenizer, base


def build(shape: str, device: torch.device, *, layers: int | None = None, shard: bool = False,
          seed: int = 0, reshard_after_forward: bool = True, quantization: str | None = None) -> Any:
    """A frozen random-weight model of `shape` made on `device`, never written to disk: bf16 on CUDA, fp32 on the
    CPU. Each weight is drawn whole on `device` from a generator seeded by its name and `seed`, so every build
    has the same weights on every device of a kind. With `shard` (torch.distributed initialised), the model is
    made on the meta device, its decoder layers are sharded over the ranks (`shard_base`) and each rank keeps only
    its shard of each weight, one whole weight in memory at a time: a shape one GPU cannot hold (70B) is built
    over several in place, where writing it to disk first took ~84 GB and ran the device's disk out (issue 37).
    With `quantization` "nf4" (issue 36) each linear layer's weight but the output head's is held in NF4 as soon as
    it is drawn (worker/engine/quantize.py), one whole bf16 weight in memory at a time: a 70B base in NF4 is built
    on one GPU that could not hold it in bf16."""
    from torch.distributed.tensor import DTensor

    from worker.engine.distributed import shard_base

    config = shape_config(shape, layers)
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config, dtype=base_dtype(device))
    model.requires_grad_(False)
    if quantization is not None:
        return _build_quantized(model, config, device, seed, quantization)
    if shard:
        # gives the meta model empty storage on `device`, shards included
        shard_base(model, device=device, reshard_after_forward=reshard_after_forward)
    else:
        model.to_empty(device=device)
    generator = torch.Generator(device=device)
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, param in model.named_parameters():
            generator.manual_seed(zlib.crc32(name.encode()) ^ seed)
            if name.endswith("norm.weight"):
                whole = torch.ones(param.shape, device=device, dtype=param.dtype)
            else:
                whole = torch.empty(param.shape, device=device, dtype=param.dtype).normal_(0.0, std,
                                                                                          generator=generator)
            if isinstance(param, DTensor):  # FSDP2 shards dim 0 as torch.chunk does; this rank keeps its chunk
                mesh = param.device_mesh
                local = torch.chunk(whole, mesh.size(), dim=0)[mesh.get_local_rank()]
                param.to_local().copy_(local)
            else:
                param.copy_(whole)
            del whole
        # Buffers computed from the config (RoPE's inverse frequencies) are not weights: made again on `device`.
        for path, module in list(model.named_modules()):
            if hasattr(module, "inv_freq"):
                model.set_submodule(path, type(module)(config=config).to(device))
    return model


def _build_quantized(model: Any, config: Any, device: torch.device, seed: int, quantization: str) -> Any:
    """`build`'s meta model given its weights one at a time on `device` (drawn as `build` draws them), each linear
    weight but the output head's held in NF4 at once."""
    from worker.engine.quantize import NF4_BLOCK, nf4_parameter

    if quantization != "nf4":
        raise ValueError(f"unknown quantization {quantization!r}")
    head = model.get_output_embeddings()
    std = float(getattr(config, "initializer_range", 0.02))
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for path, module in list(model.named_modules()):
            for name, param in list(module.named_parameters(recurse=False)):
                full = f"{path}.{name}" if path else name
                generator.manual_seed(zlib.crc32(full.encode()) ^ seed)
                if full.endswith("norm.weight"):
                    whole = torch.ones(param.shape, device=device, dtype=param.dtype)
                else:
                    whole = torch.empty(param.shape, device=device, dtype=param.dtype).normal_(
                        0.0, std, generator=generator)
                linear = isinstance(module, torch.nn.Linear) and module is not head and name == "weight"
                if linear and whole.numel() % NF4_BLOCK == 0:
                    setattr(module, name, nf4_parameter(whole))
                else:
                    setattr(module, name, torch.nn.Parameter(whole, requires_grad=False))
                del whole
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()  # the head drawn above is dropped for the embeddings, as the config says
        for path, module in list(model.named_modules()):
            if hasattr(module, "inv_freq"):
                model.set_submodule(path, type(module)(config=config).to(device))
    return model


def load(path: Path, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """A frozen copy of the model at `path`: bf16 on CUDA, fp32 on the CPU, unless `dtype` says."""
    dtype = dtype or base_dtype(device)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device)
    model.requires_grad_(False)
    return model


def make_rows(n: int, seq_len: int, seed: int, *, min_fraction: float = 0.5) -> list[dict[str, str]]:
    """Prompt/completion rows of `min_fraction`-100% of seq_len bytes (the byte tokenizer: a token a byte)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "theta", "kappa", "sigma"]

    def text(n_bytes: int) -> str:
        out = ""
        while len(out) < n_bytes:
            out += rng.choice(words) + " "
        return out[:n_bytes]

    rows = []
    for _ in range(n):
        total = rng.randint(min(int(seq_len * min_fraction), seq_len - 2), seq_len - 2)
        prompt = rng.randint(total // 4, total // 2)
        rows.append({"prompt": text(prompt), "completion": text(total - prompt)})
    return rows
