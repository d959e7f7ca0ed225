"""The model architectures LoRA can tune here, and the checks a Hugging Face model directory (or a GGUF file) must
pass to be registered. Pure: reads files only (config.json, tokenizer files, a GGUF header), never torch,
transformers or gguf, so the API can run it."""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Leaf names of the linear modules in a decoder layer, where an adapter may sit.
_SPLIT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3: the adapter sits on the fused ones

# config.json's model_type -> the module names valid as LoRA targets.
TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "llama": _SPLIT_PROJECTIONS,
    "mistral": _SPLIT_PROJECTIONS,
    "qwen2": _SPLIT_PROJECTIONS,
    "qwen3": _SPLIT_PROJECTIONS,
    "gemma2": _SPLIT_PROJECTIONS,
    "gemma3_text": _SPLIT_PROJECTIONS,
    "phi3": _FUSED_PROJECTIONS,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(TARGET_MODULES))
# The architectures whose adapters export as a llama.cpp LoRA GGUF (worker/gguf_export.py): llama.cpp's names for
# their layers are known to the `gguf` package, and their adapters sit on split projections (Phi-3's fused ones and
# Gemma's are not written yet).
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def export_formats(architecture: str | None) -> tuple[str, ...]:
    """The download formats of an adapter on a base of ``architecture`` (None: not inspected, as the built-ins' older
    rows: taken as llama, which every built-in is)."""
    return ("peft", "merged", "gguf") if (architecture or "llama") in GGUF_ARCHITECTURES else ("peft", "merged")
# Every target name of some architecture, in the canonical order a choice of modules is stored in.
ALL_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                      "down_proj")
# Every linear layer of the decoder except lm_head: on a model, exactly its TARGET_MODULES names.
ALL_LINEAR = "all-linear"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class ModelDirError(ValueError):
    """A model directory that cannot be registered. `code` is machine readable; the message says what is wrong."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    max_context: int | None
    target_modules: tuple[str, ...]
    has_chat_template: bool
    parameters: int | None = None  # from the safetensors headers; None where they cannot be read


def target_modules_for(architecture: str | None) -> tuple[str, ...] | None:
    """The LoRA target names of a registered architecture (what "all-linear" stands for on it); None when it is
    unknown (a GGUF file whose header could not be read)."""
    return TARGET_MODULES.get(architecture) if architecture else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        message = f"{path.name} in {path.parent} is not readable JSON: {exc}"
        raise ModelDirError("model_config_invalid", message) from exc


def _architecture(config: dict[str, Any], where: Path) -> str:
    """The config's model_type, when it is a supported one."""
    model_type = config.get("model_type")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not isinstance(model_type, str) or not model_type:
        raise ModelDirError("unsupported_architecture",
                            f"config.json in {where} has no model_type; supported: {supported}.")
    if model_type == "gemma3":  # transformers loads it as Gemma3ForConditionalGeneration, vision tower and all
        raise ModelDirError("unsupported_architecture",
                            f"model_type 'gemma3' in {where} is the multimodal Gemma 3, which is not supported; "
                            f"text-only Gemma 3 checkpoints (model_type 'gemma3_text') are. Supported: {supported}.")
    if model_type not in TARGET_MODULES:
        raise ModelDirError("unsupported_architecture",
                            f"model_type '{model_type}' in {where} is not supported; supported: {supported}.")
    return model_type


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file():
        return True
    tokenizer_config = directory / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        return False
    try:
        data = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and bool(data.get("chat_template"))


def inspect_model_dir(path: str | Path) -> ModelInfo:
    """Check that `path` is a Hugging Face model directory of a supported architecture and describe it.

    Raises:
        ModelDirError: naming what is wrong (missing directory, config.json, weights or tokenizer, unreadable
            config, unsupported model_type).
    """
    directory = Path(path)
    if not directory.exists():
        raise ModelDirError("model_path_not_found", f"{directory} does not exist.")
    if not directory.is_dir():
        raise ModelDirError("model_path_not_a_directory", f"{directory} is not a directory.")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelDirError("model_config_missing", f"{directory} has no config.json.")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ModelDirError("model_config_invalid", f"config.json in {directory} is not a JSON object.")
    architecture = _architecture(config, directory)
    if not any(directory.glob("*.safetensors")):
        raise ModelDirError("model_weights_missing", f"{directory} has no weights (*.safetensors files).")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError("model_tokenizer_missing",
                            f"{directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)}).")
    max_context = config.get("max_position_embeddings")
    return ModelInfo(
        architecture=architecture,
        max_context=max_context if isinstance(max_context, int) and not isinstance(max_context, bool) else None,
        target_modules=TARGET_MODULES[architecture],
        has_chat_template=_has_chat_template(directory),
        parameters=_parameter_count(directory),
    )


_SAFETENSORS_MAX_HEADER = 100 * 2**20


def _parameter_count(directory: Path) -> int | None:
    """The parameters in the directory's safetensors files, from their headers (a little-endian u64 length, then
    JSON naming each tensor's shape): no weights are read. None where a header cannot be read."""
    total = 0
    try:
        for file in sorted(directory.glob("*.safetensors")):
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > _SAFETENSORS_MAX_HEADER:
                    return None
                header = json.loads(f.read(length))
            for name, tensor in header.items():
                if name != "__metadata__":
                    total += math.prod(int(n) for n in tensor["shape"])
    except (OSError, struct.error, ValueError, TypeError, KeyError):  # JSONDecodeError is a ValueError
        return None
    return total


# ---- GGUF files -------------------------------------------------------------------------------------------------
# Our own header reader, not gguf.GGUFReader: that one parses every array and tensor record up front (4 s on the
# 100 MB SmolLM2 file, against 45 ms here, inside a registration request) and is not a dependency of the API.

GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)  # version 1 (2023) counted in 32 bits; such a file reads as unknown
# Metadata value types: the struct format of each scalar; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_KEYS = 100_000  # a real header has a few dozen
_GGUF_KEPT_STRINGS = frozenset({"general.architecture", "tokenizer.chat_template"})


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF file's header says; each field None where it could not be read."""

    architecture: str | None  # general.architecture
    max_context: int | None  # <architecture>.context_length
    has_chat_template: bool | None  # tokenizer.chat_template


class _GgufReader:
    """The key/value header of a GGUF file, read from a buffer without copying the arrays (the vocabulary)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError("the header runs past the end of the file")
        self.pos += n

    def string(self, keep: bool) -> str | None:
        start, n = self.pos + 8, self.scalar("<Q")
        self.skip(n)
        return bytes(self.buf[start:start + n]).decode("utf-8") if keep else None

    def value(self, kind: int, keep: bool) -> Any:
        if kind == _GGUF_STRING:
            return self.string(keep)
        if kind == _GGUF_ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _GGUF_SCALARS:
                self.skip(count * struct.calcsize(_GGUF_SCALARS[item]))
                return None
            if count * 8 > len(self.buf) - self.pos:  # each string or array takes at least 8 bytes
                raise ValueError("an array longer than the file")
            for _ in range(count):
                self.value(item, keep=False)
            return None
        fmt = _GGUF_SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(fmt)

    def metadata(self) -> dict[str, Any]:
        """The header's keys with their scalar values and the strings of `_GGUF_KEPT_STRINGS` (arrays as None)."""
        self.pos = len(GGUF_MAGIC)
        if self.scalar("<I") not in _GGUF_VERSIONS:
            raise ValueError("unsupported GGUF version")
        self.scalar("<Q")  # tensor count
        keys = self.scalar("<Q")
        if keys > _GGUF_MAX_KEYS:
            raise ValueError("implausible key count")
        out: dict[str, Any] = {}
        for _ in range(keys):
            key = self.string(keep=True)
            assert key is not None
            out[key] = self.value(self.scalar("<I"), keep=key in _GGUF_KEPT_STRINGS)
        return out


def inspect_gguf(path: str | Path) -> GgufInfo:
    """What can be known of a GGUF file from its header: architecture, context length, whether it embeds a chat
    template. A header that cannot be read (truncated, an old version) gives None for each.

    Raises:
        ModelDirError: the file is not GGUF (no magic) or cannot be read (`model_file_invalid`), or its
            architecture is not supported (`unsupported_architecture`).
    """
    path = Path(path)
    unknown = GgufInfo(architecture=None, max_context=None, has_chat_template=None)
    try:
        with path.open("rb") as f:
            if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                raise ModelDirError("model_file_invalid", f"{path} is not a GGUF file (it does not start with GGUF).")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                try:
                    meta = _GgufReader(buf).metadata()
                except (struct.error, ValueError, OverflowError):  # UnicodeDecodeError is a ValueError
                    return unknown
    except OSError as exc:
        raise ModelDirError("model_file_invalid", f"{path} cannot be read: {exc}") from exc
    architecture = meta.get("general.architecture")
    has_chat_template = bool(meta.get("tokenizer.chat_template"))
    if not isinstance(architecture, str) or not architecture:
        return GgufInfo(architecture=None, max_context=None, has_chat_template=has_chat_template)
    if architecture not in TARGET_MODULES:
        raise ModelDirError("unsupported_architecture", f"{path} holds a '{architecture}' model, which is not "
                            f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}.")
    context = meta.get(f"{architecture}.context_length")
    return GgufInfo(
        architecture=architecture,
        max_context=context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None,
        has_chat_template=has_chat_template,
    )
