"""The tiny random Llama: deterministic, loaded like a real checkpoint; its byte-level tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from common.tiny_tokenizer import TINY_TOKENIZER
from tests.engine.factories import CPU, TINY
from worker.engine import ModelSource, load_base_model
from worker.engine import base_model as engine_models


def test_tiny_model_materialises_deterministically(tmp_path: Path, model_cache: Path) -> None:
    # a no-op once another test has loaded it
    engine_models.materialize_tiny_llama(model_cache / TINY.name, TINY_TOKENIZER)
    engine_models.materialize_tiny_llama(tmp_path / "again", TINY_TOKENIZER)
    first = load_file(str(model_cache / TINY.name / "model.safetensors"))
    second = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)
    # Pinned: the fixed seed gives these weights (torch CPU RNG; 2 layers, hidden 64, vocab 259).
    assert first["model.embed_tokens.weight"].shape == (259, 64)
    assert first["model.embed_tokens.weight"].sum().item() == pytest.approx(-0.10607, abs=1e-4)
    assert first["lm_head.weight"].abs().sum().item() == pytest.approx(265.1658, abs=1e-2)


def test_tiny_model_loads_frozen_through_from_pretrained(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase], model_cache: Path
) -> None:
    model, tokenizer = tiny
    assert isinstance(model, LlamaForCausalLM)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(model_cache / TINY.name))
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    assert model.dtype == torch.float32
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.layers[0].self_attn.k_proj.out_features == 32  # GQA: 2 kv heads of 16


def test_tiny_tokenizer_is_byte_level_and_round_trips(tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    _, tokenizer = tiny
    text = "héllo, wörld!\n\ttabs & emoji 🎉"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # token id == byte value
    assert tokenizer.decode(ids) == text
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|pad|>", 256)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 258)
    assert tokenizer("<|im_start|>a", add_special_tokens=False)["input_ids"] == [257, ord("a")]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_losing_a_materialisation_race_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "tiny"
    real_rename = os.rename

    def rename_after_rival(src: str | Path, dst: str | Path) -> None:
        Path(dst).mkdir()
        (Path(dst) / "winner").write_text("rival process got here first")
        real_rename(src, dst)  # raises: dst exists and is not empty

    monkeypatch.setattr(engine_models.os, "rename", rename_after_rival)
    assert engine_models.materialize_tiny_llama(target, TINY_TOKENIZER) == target
    assert os.listdir(target) == ["winner"]
    assert os.listdir(tmp_path) == ["tiny"]  # the loser's temp dir is gone


def test_unknown_kind_and_missing_package_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        load_base_model(ModelSource("x", "onnx"), cache_dir=tmp_path, device=CPU)
    missing = ModelSource("x", "gguf-package", package="no_such_model_package_xyz", gguf_file="m.gguf")
    with pytest.raises(FileNotFoundError, match="not installed"):
        load_base_model(missing, cache_dir=tmp_path, device=CPU)
    with pytest.raises(ValueError, match="needs a path"):
        load_base_model(ModelSource("x", "hf"), cache_dir=tmp_path, device=CPU)
    with pytest.raises(FileNotFoundError, match="m.gguf does not exist"):  # an operator's gguf registration
        load_base_model(ModelSource("x", "gguf", path=str(tmp_path), gguf_file="m.gguf"), cache_dir=tmp_path,
                        device=CPU)  # fmt: skip
    with pytest.raises(ValueError, match="needs path and gguf_file"):
        load_base_model(ModelSource("x", "gguf", path=str(tmp_path)), cache_dir=tmp_path, device=CPU)
