"""A trial's adapter as a llama.cpp LoRA adapter GGUF (issue 35, `GET .../adapter?format=gguf`): the file
`llama-cli -m base.gguf --lora adapter.gguf` and Ollama's `ADAPTER` load over a GGUF of the same base model.

Written with the `gguf` package, as llama.cpp's own `convert_lora_to_gguf.py` writes one: `general.type` "adapter",
`adapter.type` "lora", `adapter.lora.alpha` (llama.cpp scales by alpha / rank), the base's `general.architecture`,
and for each adapted layer its llama.cpp tensor name (the `gguf` package's map: `model.layers.0.self_attn.q_proj` is
`blk.0.attn_q`) with `.weight.lora_a` (A, rank x in) and `.weight.lora_b` (B, out x rank). llama.cpp's converter
stores a Llama's query and key weights with their rows permuted (the rotary halves interleaved); a LoRA delta B A on
them is permuted the same way, which for a product is B's rows alone (`permute_rows`). rsLoRA's alpha / sqrt(rank) is
written as the alpha that gives the same scale under llama.cpp's alpha / rank.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from common.architectures import GGUF_ARCHITECTURES
from worker.engine.export import read_peft_adapter

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
             "qwen3": gguf.MODEL_ARCH.QWEN3}
assert set(GGUF_ARCH) == set(GGUF_ARCHITECTURES)
PERMUTED = ("llama", "mistral")  # llama.cpp's converter permutes these architectures' q and k rows


def permute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """The rows of a query (or key, with its own head count) weight in llama.cpp's order: within each head, the two
    rotary halves interleaved (convert_hf_to_gguf's `permute`)."""
    out = weight.shape[0]
    return weight.reshape(n_head, 2, out // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_adapter_gguf(adapter_dir: Path, config: Any, out: Path) -> Path:
    """``adapter_dir`` (a PEFT adapter) as a LoRA GGUF at ``out`` for a base of ``config`` (its transformers config).
    Raises ValueError for an architecture or a layer llama.cpp's names do not cover."""
    model_type = str(config.model_type)
    if model_type not in GGUF_ARCH:
        raise ValueError(f"no GGUF export for architecture {model_type!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    lora, tensors = read_peft_adapter(adapter_dir)
    arch = GGUF_ARCH[model_type]
    names = gguf.get_tensor_name_map(arch, int(config.num_hidden_layers))
    n_head = int(config.num_attention_heads)
    n_kv_head = int(getattr(config, "num_key_value_heads", None) or n_head)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    alpha = lora.alpha * math.sqrt(lora.rank) if lora.use_rslora else lora.alpha
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for path, (a, b) in sorted(tensors.items()):
        name = names.get_name(path)
        if name is None:
            raise ValueError(f"layer {path!r} has no llama.cpp name for architecture {model_type!r}")
        if model_type in PERMUTED and path.endswith(".q_proj"):
            b = permute_rows(b, n_head)
        elif model_type in PERMUTED and path.endswith(".k_proj"):
            b = permute_rows(b, n_kv_head)
        writer.add_tensor(f"{name}.weight.lora_a", np.ascontiguousarray(a.float().numpy()))
        writer.add_tensor(f"{name}.weight.lora_b", np.ascontiguousarray(b.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
