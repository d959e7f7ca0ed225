"""The model architectures LoRA can tune here, and the checks a Hugging Face model directory must pass to be
registered. Pure: reads files only (config.json, tokenizer files), never torch or transformers, so the API can
run it."""

from __future__ import annotations

import json
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
    "gemma3": _SPLIT_PROJECTIONS,  # only with a nested text_config (the language model of Gemma 3)
    "phi3": _FUSED_PROJECTIONS,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(TARGET_MODULES))

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


def target_modules_for(architecture: str | None) -> tuple[str, ...] | None:
    """The LoRA target names of a registered architecture; None when it is unknown (built-ins, GGUF)."""
    return TARGET_MODULES.get(architecture) if architecture else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        message = f"{path.name} in {path.parent} is not readable JSON: {exc}"
        raise ModelDirError("model_config_invalid", message) from exc


def _architecture(config: dict[str, Any], where: Path) -> tuple[str, dict[str, Any]]:
    """(model_type, the config holding the language model's fields)."""
    model_type = config.get("model_type")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not isinstance(model_type, str) or not model_type:
        raise ModelDirError("unsupported_architecture",
                            f"config.json in {where} has no model_type; supported: {supported}.")
    if model_type not in TARGET_MODULES:
        raise ModelDirError("unsupported_architecture",
                            f"model_type '{model_type}' in {where} is not supported; supported: {supported}.")
    if model_type == "gemma3":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ModelDirError("unsupported_architecture",
                                f"model_type 'gemma3' in {where} has no text_config; supported: {supported}.")
        return model_type, text
    return model_type, config


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
    architecture, text_config = _architecture(config, directory)
    if not any(directory.glob("*.safetensors")):
        raise ModelDirError("model_weights_missing", f"{directory} has no weights (*.safetensors files).")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError("model_tokenizer_missing",
                            f"{directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)}).")
    max_context = text_config.get("max_position_embeddings")
    return ModelInfo(
        architecture=architecture,
        max_context=max_context if isinstance(max_context, int) and not isinstance(max_context, bool) else None,
        target_modules=TARGET_MODULES[architecture],
        has_chat_template=_has_chat_template(directory),
    )
