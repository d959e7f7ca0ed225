"""Write and read adapters in PEFT's LoRA format (``adapter_config.json`` + ``adapter_model.safetensors``).

The format is what ``peft.PeftModel.from_pretrained`` and vLLM's ``--enable-lora`` load: keys
``base_model.model.<module path>.lora_A.weight`` ``(r, in)`` and ``.lora_B.weight`` ``(out, r)`` with the
adapter name stripped (``peft/utils/save_and_load.py::get_peft_model_state_dict``), no ``modules_to_save``,
no DoRA (vLLM refuses both).
"""

from __future__ import annotations

import json
import math
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from kernels import build_segments
from worker.engine.lora import LoraConfig, LoraContext, TokenRouting, inject_lora, restore_base_model
from worker.engine.store import AdapterStore, ModuleTensors
from worker.engine.trial_files import write_dir_atomically

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def export_peft_adapter(
    out_dir: Path,
    tensors: ModuleTensors,
    *,
    config: LoraConfig,
    target_modules: list[str],
    base_model_name: str,
) -> Path:
    """Write one adapter to ``out_dir`` atomically (an existing ``out_dir``, e.g. a redelivered task's, is replaced).

    Args:
        out_dir: destination directory.
        tensors: ``{module path: (A (r, in), B (out, r))}``, the adapter's true rank (no padding).
        config: rank, alpha, dropout and rsLoRA flag of the adapter.
        target_modules: the ``target_modules`` list PEFT will match layers with.
        base_model_name: recorded as ``base_model_name_or_path``.
    """
    shapes, flat = flat_peft_tensors(tensors)
    return write_peft_adapter(out_dir, shapes, flat.cpu(), config=config, target_modules=target_modules,
                              base_model_name=base_model_name)


def flat_peft_tensors(tensors: ModuleTensors) -> tuple[dict[str, list[int]], torch.Tensor]:
    """The adapter's tensors under PEFT's names with their shapes, and their float32 values end to end in one flat
    tensor on their device (the safetensors file's data, in that order): one copy to the host, one write."""
    named: dict[str, torch.Tensor] = {}
    for path, (lora_a, lora_b) in tensors.items():
        named[f"{_PREFIX}{path}.lora_A.weight"] = lora_a
        named[f"{_PREFIX}{path}.lora_B.weight"] = lora_b
    flat = torch.cat([t.detach().to(torch.float32).contiguous().reshape(-1) for t in named.values()])
    return {name: list(t.shape) for name, t in named.items()}, flat


class Writable(Protocol):
    def write(self, data: bytes | memoryview, /) -> object: ...


@dataclass(frozen=True)
class PeftFiles:
    """A PEFT adapter's two files in memory (``peft_files``), each ``{name: its bytes in pieces}``: written as a
    directory (``write_dir``) or as a plain tar into one open file (``write_tar``: an adapter checkpoint goes straight
    into the artifact store that way, one write, no directory to write, read back and archive first)."""

    files: dict[str, tuple[bytes | memoryview, ...]]

    @property
    def size(self) -> int:
        return sum(len(piece) for pieces in self.files.values() for piece in pieces)

    def write_dir(self, out_dir: Path) -> Path:
        """The files in ``out_dir``, atomically (an existing one is replaced)."""

        def write(tmp: Path) -> None:
            for name, pieces in self.files.items():
                with (tmp / name).open("wb") as f:
                    for piece in pieces:
                        f.write(piece)

        return write_dir_atomically(Path(out_dir), write)

    def write_tar(self, out: Writable) -> int:
        """The files as a POSIX tar archive (``tarfile`` reads it: each member's header block, its data padded to 512
        bytes, two zero blocks at the end), written to ``out``; returns the bytes written. Written by hand because
        ``tarfile`` copies a member from a file object in pieces, and the data is already one buffer."""
        written = 0
        for name, pieces in self.files.items():
            size = sum(len(piece) for piece in pieces)
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = size, 0o600, int(time.time())
            header = info.tobuf(format=tarfile.PAX_FORMAT)
            padding = b"\0" * (-size % tarfile.BLOCKSIZE)
            for piece in (header, *pieces, padding):
                out.write(piece)
            written += len(header) + size + len(padding)
        out.write(b"\0" * (2 * tarfile.BLOCKSIZE))
        return written + 2 * tarfile.BLOCKSIZE


def write_peft_adapter(out_dir: Path, shapes: dict[str, list[int]], flat: torch.Tensor, *, config: LoraConfig,
                       target_modules: list[str], base_model_name: str) -> Path:
    """``flat_peft_tensors``' output (``flat`` on the host) as a PEFT directory, atomically."""
    return peft_files(shapes, flat, config=config, target_modules=target_modules,
                      base_model_name=base_model_name).write_dir(out_dir)


def peft_files(shapes: dict[str, list[int]], flat: torch.Tensor, *, config: LoraConfig, target_modules: list[str],
               base_model_name: str) -> PeftFiles:
    """``flat_peft_tensors``' output (``flat`` on the host) as a PEFT adapter's files, in memory. The safetensors file
    is built here, the header and then the data as one buffer: safetensors' ``save_file`` takes a tensor each, and a
    few hundred tensor operations on the pack's writer thread contended with the training thread for the GIL, costing
    a SmolLM2 pack 0.7 s of training per checkpoint (benchmarks/checkpoint_cost.py). The format is safetensors' own:
    8 bytes of header length, the JSON header (names, dtype, shape, byte offsets into the data), the data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if offset != flat.numel() * 4:
        raise ValueError(f"the adapter's data has {flat.numel() * 4} bytes, its tensors {offset}")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    data = flat.detach().to(torch.float32).contiguous().numpy().data.cast("B")
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
        "use_rslora": config.use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    return PeftFiles({
        ADAPTER_CONFIG: ((json.dumps(adapter_config, indent=2) + "\n").encode(),),
        ADAPTER_WEIGHTS: (len(raw).to_bytes(8, "little") + raw, data),
    })


def read_peft_adapter(adapter_dir: Path) -> tuple[LoraConfig, ModuleTensors]:
    """Read a LoRA adapter written by ``export_peft_adapter`` (or plain PEFT without DoRA or rank patterns).

    Returns:
        The config and ``{module path: (A (r, in), B (out, r))}``.

    Raises:
        ValueError: a DoRA adapter, or per-module rank / alpha patterns.
    """
    adapter_config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    if adapter_config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: DoRA adapters are not supported")
    if adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern"):
        raise ValueError(f"{adapter_dir}: per-module rank / alpha patterns are not supported")
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
        use_rslora=bool(adapter_config.get("use_rslora", False)),
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

    Wraps the adapter's layers in the engine's own LoRA layers (one slot), runs one eval forward (no
    dropout) and unwraps them again: the model is left as it was found.

    Raises:
        ValueError: the model is in use by a pack (it already has LoRA layers).
    """
    config, tensors = read_peft_adapter(adapter_dir)
    parameter = next(model.parameters())
    device = parameter.device
    context = LoraContext()
    layers = inject_lora(model, list(tensors), context)
    try:
        store = AdapterStore(layers, capacity=1, max_rank=config.rank, device=device, compute_dtype=parameter.dtype)
        store.load_slot(0, tensors, rank=config.rank, scale=config.scale)
        routing = TokenRouting(build_segments([0], [input_ids.numel()], num_slots=1, device=device))
        mask = attention_mask.to(device) if attention_mask is not None else None
        with context.routed(routing):
            return model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False).logits
    finally:
        restore_base_model(model)
