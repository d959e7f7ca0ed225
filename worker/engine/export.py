"""Write and read adapters in PEFT's LoRA format (``adapter_config.json`` + ``adapter_model.safetensors``).

The format is what ``peft.PeftModel.from_pretrained`` and vLLM's ``--enable-lora`` load: keys
``base_model.model.<module path>.lora_A.weight`` ``(r, in)`` and ``.lora_B.weight`` ``(out, r)`` with the
adapter name stripped (``peft/utils/save_and_load.py::get_peft_model_state_dict``), no ``modules_to_save``,
no DoRA (vLLM refuses both).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from worker.engine.lora import (
    LoraConfig,
    adapter_context,
    load_adapter,
    remove_adapter,
    restore_base_model,
    set_active_adapter,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def export_peft_adapter(
    out_dir: Path,
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    config: LoraConfig,
    target_modules: list[str],
    base_model_name: str,
) -> Path:
    """Write one adapter to ``out_dir`` atomically.

    Both files go to a temp dir next to ``out_dir`` that is then renamed into place, so readers never see
    a half-written adapter. An existing ``out_dir`` (a redelivered task) is replaced.

    Args:
        out_dir: destination directory.
        tensors: ``{module path: (A (r, in), B (out, r))}``.
        config: rank, alpha and dropout of the adapter.
        target_modules: the ``target_modules`` list PEFT will match layers with.
        base_model_name: recorded as ``base_model_name_or_path``.
    """
    state = {}
    for path, (lora_a, lora_b) in tensors.items():
        state[f"{_PREFIX}{path}.lora_A.weight"] = lora_a.detach().to("cpu", torch.float32).contiguous()
        state[f"{_PREFIX}{path}.lora_B.weight"] = lora_b.detach().to("cpu", torch.float32).contiguous()
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": config.rank,
        "lora_alpha": int(config.alpha) if float(config.alpha).is_integer() else config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
        if out_dir.exists():
            # A directory cannot be renamed onto a non-empty one: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            shutil.rmtree(old)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def read_peft_adapter(adapter_dir: Path) -> tuple[LoraConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Read a LoRA adapter written by ``export_peft_adapter`` (or plain PEFT without rsLoRA / DoRA).

    Returns:
        The config and ``{module path: (A (r, in), B (out, r))}``.
    """
    adapter_config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    if adapter_config.get("use_rslora") or adapter_config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: rsLoRA / DoRA adapters are not supported")
    state = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    tensors = {}
    for key, lora_a in state.items():
        if key.endswith(".lora_A.weight"):
            path = key.removeprefix(_PREFIX).removesuffix(".lora_A.weight")
            tensors[path] = (lora_a, state[f"{_PREFIX}{path}.lora_B.weight"])
    config = LoraConfig(
        rank=int(adapter_config["r"]),
        alpha=float(adapter_config["lora_alpha"]),
        dropout=float(adapter_config.get("lora_dropout", 0.0)),
    )
    return config, tensors


@torch.no_grad()
def adapter_logits(
    model: PreTrainedModel,
    adapter_dir: Path,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The engine's logits ``(batch, seq, vocab)`` for ``input_ids`` ``(batch, seq)`` under a saved adapter.

    Loads the adapter into a spare slot of the engine's own LoRA layers, runs one eval forward (no
    dropout) and removes the slot again; the model is left as it was found.
    """
    config, tensors = read_peft_adapter(adapter_dir)
    context = adapter_context(model)
    had_layers = context is not None
    slot = max(context.slots, default=-1) + 1 if context is not None else 0
    previous = (context.active, context.training) if context is not None else (None, False)
    load_adapter(model, slot, config, tensors)
    try:
        set_active_adapter(model, slot, training=False)
        device = next(model.parameters()).device
        mask = attention_mask.to(device) if attention_mask is not None else None
        return model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False).logits
    finally:
        remove_adapter(model, slot)
        if had_layers:
            set_active_adapter(model, previous[0], training=previous[1])
        else:
            restore_base_model(model)
