"""Real Hugging Face model directories for registry and engine tests: a tiny randomly initialised model of each
supported architecture (its real `transformers` config class, saved with `save_pretrained` as safetensors, and a
byte-level tokenizer with a chat template), and broken variants of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from common.tiny_tokenizer import TINY_TOKENIZER
from worker.engine.base_model import build_tiny_tokenizer, materialize_tiny_llama

# The smallest shapes that keep each family's features: grouped-query attention, Qwen2's q/k/v biases, Qwen3's
# and Gemma 3's q/k norms, Gemma's embedding scale and (1 + w) norms, Gemma 2's soft caps, Phi-3's fused
# projections; the windowed families get a window of 16 tokens, shorter than the tests' rows, so the sliding
# window is exercised (and one layer of each Gemma keeps full attention).
_SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                          "initializer_range": 0.1}
_WINDOW = {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {"tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, {"head_dim": 16, "tie_word_embeddings": True}),
    "mistral": (MistralConfig, {"head_dim": 16, "sliding_window": 16}),
    "gemma2": (Gemma2Config, {"head_dim": 16, "query_pre_attn_scalar": 16, **_WINDOW}),
    "gemma3_text": (Gemma3TextConfig, {"head_dim": 16, "query_pre_attn_scalar": 16, **_WINDOW}),
    "phi3": (Phi3Config, {"tie_word_embeddings": False}),
}
TINY_SEED = 0


def tiny_llama_dir(path: Path) -> Path:
    """`path`, holding config.json (model_type llama), model.safetensors and tokenizer.json."""
    return materialize_tiny_llama(path, TINY_TOKENIZER)


def tiny_model_dir(architecture: str, path: Path, *, chat_template: bool = True) -> Path:
    """A tiny random model of `architecture` (a key of ARCHITECTURES) saved at `path` with its tokenizer.

    The weights come from a fixed seed, so two directories of one architecture hold the same model.
    """
    config_class, extra = ARCHITECTURES[architecture]
    tokenizer = build_tiny_tokenizer(TINY_TOKENIZER)
    if not chat_template:
        tokenizer.chat_template = None
    config = config_class(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, **_SHAPE, **extra,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = AutoModelForCausalLM.from_config(config)
        # Random norm weights and biases: at their initial ones and zeros they would hide a missing (1 + w) or bias.
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def copy_without(source: Path, target: Path, *names: str) -> Path:
    """A copy of the model directory `source` at `target` lacking the files `names`."""
    shutil.copytree(source, target)
    for name in names:
        (target / name).unlink()
    return target


def with_config(source: Path, target: Path, **changes: object) -> Path:
    """A copy of `source` at `target` whose config.json has `changes` applied."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target
