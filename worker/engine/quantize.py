"""4-bit frozen bases (QLoRA, issue 36): a registered model with ``quantization: "nf4"`` has the weights of its linear
layers held in NormalFloat4 (Dettmers et al., QLoRA), the LoRA path unchanged in the base's own dtype.

NF4 is torchao's ``NF4Tensor`` (4-bit codes in blocks of 64 values, each block's scale itself quantised to 8 bits in
blocks of up to 256: ~0.52 bytes a parameter against bf16's 2). Chosen over bitsandbytes because it runs on the CPU
too (the suite tests the layers the GPUs run), it is what torchtune's QLoRA uses, and it is a plain tensor subclass:
``F.linear`` de-quantises it on the fly in autograd, so the engine's base matmul needs no kernel of its own
(``kernels.lora_linear`` sends a quantised weight through ``F.linear`` and the LoRA delta through its torch path).
The output projection and the embeddings stay in the base's dtype, as QLoRA keeps them.

A layer whose size NF4's blocks do not divide is left as it is (logged): real models' projections all fit.

A base in a directory of safetensors is loaded straight into NF4 (`load_nf4_streamed`): the model made on the meta
device, each tensor read from its file onto the device and a linear weight quantised at once, so the device never holds
the bf16 base whole (a 70B base is 140 GB in bf16; a GPU holds its 37 GiB in NF4: docs/benchmarks.md)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger(__name__)

QUANTIZATIONS = ("nf4",)
NF4_BLOCK = 64  # values per 4-bit block (torchao's default, QLoRA's)
NF4_SCALER_BLOCK = 256  # block scales per 8-bit second-level block, at most


def nf4_parameter(weight: torch.Tensor) -> nn.Parameter:
    """``weight`` (a linear layer's, a whole number of NF4 blocks) as a frozen NF4 parameter."""
    return nn.Parameter(_nf4(weight), requires_grad=False)


def _nf4(weight: torch.Tensor) -> Any:
    # Imported here: torchao is loaded only where a quantised base is (its import costs a second and logs a line
    # about CUDA kernels it cannot load on a CPU).
    from torchao.quantization import NF4Tensor

    blocks = weight.numel() // NF4_BLOCK
    return NF4Tensor.from_tensor(weight.detach(), NF4_BLOCK, math.gcd(blocks, NF4_SCALER_BLOCK))


def quantize_nf4(model: nn.Module) -> int:
    """Hold the weight of every linear layer of ``model`` but its output projection in NF4, in place; returns how
    many layers were quantised."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    done = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is output or is_quantized(module.weight):
            continue
        if module.weight.numel() % NF4_BLOCK:
            log.warning("layer %s (%s) is not a whole number of NF4 blocks: left unquantised", name,
                        tuple(module.weight.shape))
            continue
        module.weight = nf4_parameter(module.weight)
        done += 1
    return done


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a quantised tensor subclass (not a plain tensor or parameter)."""
    return type(weight) not in (torch.Tensor, nn.Parameter)


def dequantize(model: nn.Module) -> int:
    """Replace every quantised linear weight of ``model`` with its de-quantised values (what training saw, not the
    checkpoint's original weights), in place; returns how many. For a merged export: the adapter was trained against
    these weights, so it is merged into them."""
    done = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and is_quantized(module.weight):
            weight: Any = module.weight  # an NF4Tensor
            module.weight = nn.Parameter(weight.get_original_weight(), requires_grad=False)
            done += 1
    return done


def tensor_bytes(model: nn.Module) -> int:
    """The bytes ``model``'s parameters and buffers hold (a quantised weight: its codes and scales)."""
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if is_quantized(tensor):
            inner, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]  # a tensor subclass's parts
            total += sum(getattr(tensor, part).numel() * getattr(tensor, part).element_size() for part in inner)
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def load_nf4_streamed(path: Path, *, dtype: torch.dtype, device: torch.device) -> PreTrainedModel | None:
    """The model in the directory ``path`` on ``device`` with its linear layers in NF4, read tensor by tensor from its
    safetensors files; None where it cannot be (no safetensors, or a checkpoint whose names are not the model's own:
    transformers renames some architectures' weights as it loads them), for the caller to load it whole."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.requires_grad_(False)
    head = model.get_output_embeddings()
    owners = {f"{name}.{p}": (module, p) for name, module in model.named_modules()
              for p, _ in module.named_parameters(recurse=False)}
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 - safe_open's handle is no mapping
                    if key not in owners:
                        log.info("%s: weight %s is not the model's own name; loading the base whole", path, key)
                        return None
                    module, name = owners.pop(key)
                    tensor = f.get_tensor(key).to(dtype)
                    linear = isinstance(module, nn.Linear) and module is not head and name == "weight"
                    quantise = linear and tensor.numel() % NF4_BLOCK == 0
                    value = nf4_parameter(tensor) if quantise else nn.Parameter(tensor, requires_grad=False)
                    setattr(module, name, value)
                    del tensor
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        missing = [key for key, (module, name) in owners.items() if getattr(module, name).is_meta]
        if missing:
            log.info("%s: no weights for %s; loading the base whole", path, missing[:3])
            return None
        for name, module in list(model.named_modules()):  # buffers computed from the config (RoPE's frequencies)
            if any(b.is_meta for b in module.buffers(recurse=False)):
                model.set_submodule(name, type(module)(config=config).to(device))
    model.eval()
    return model
