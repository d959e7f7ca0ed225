"""common/architectures.py: which config.json files can be registered, and the LoRA targets of each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.architectures import ModelDirError, inspect_model_dir


def _model_dir(path: Path, config: dict[str, object], *, tokenizer: str = "tokenizer.json") -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    (path / tokenizer).write_bytes(b"{}")
    return path


def test_phi3_targets_the_fused_projections(tmp_path: Path) -> None:
    from transformers import Phi3Config

    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=4096).to_dict()
    path = _model_dir(tmp_path / "phi3", config, tokenizer="tokenizer.model")
    (path / "chat_template.jinja").write_text("{{ messages }}")
    info = inspect_model_dir(path)
    assert (info.architecture, info.max_context, info.has_chat_template) == ("phi3", 4096, True)
    assert info.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_gemma3_reads_its_text_config(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "g", {"model_type": "gemma3", "text_config": {"max_position_embeddings": 8192}})
    info = inspect_model_dir(path)
    assert (info.architecture, info.max_context, info.has_chat_template) == ("gemma3", 8192, False)
    assert "q_proj" in info.target_modules
    with pytest.raises(ModelDirError, match="no text_config") as caught:
        inspect_model_dir(_model_dir(tmp_path / "g2", {"model_type": "gemma3"}))
    assert caught.value.code == "unsupported_architecture"


def test_chat_template_in_tokenizer_config(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "q", {"model_type": "qwen2", "max_position_embeddings": 32768})
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert inspect_model_dir(path).has_chat_template


def test_a_missing_model_type_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no model_type; supported: gemma2, gemma3, gemma3_text, llama"):
        inspect_model_dir(_model_dir(tmp_path / "x", {"hidden_size": 8}))
