"""Exports (worker/exports.py): a build that cannot be made says why at its failure key (the API reports it once, then
asks again), one already stored is not built twice; the GGUF adapter (worker/gguf_export.py), read back with the
`gguf` package's reader: llama.cpp's names and layout, Llama's query and key rows permuted as llama.cpp's converter
permutes its base, other architectures as they are. The merge itself: tests/e2e/test_trained_adapters.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen2Config

from common.artifacts import LocalArtifactStore, export_failure_key, export_key
from common.messages import ExportRequest, ModelSourceFields
from tests.conftest import MODEL_CACHE
from worker.engine import export_peft_adapter
from worker.engine.lora import LoraConfig
from worker.exports import build_export
from worker.gguf_export import permute_rows, write_adapter_gguf
from worker.pack_runner import tar_dir

TINY = ModelSourceFields(name="tiny-random-llama", kind="tiny-random-llama")


def request(adapter_key: str) -> ExportRequest:
    return ExportRequest(task_id="task-1", trial_id="trial-1", adapter_key=adapter_key, base_model=TINY)


def test_a_build_without_its_adapter_stores_why_and_no_archive(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    build_export(request("adapters/task-1/gone.tar.gz"), store=store, cache_dir=tmp_path / "models")
    assert not store.exists(export_key("task-1", "trial-1", "merged"))
    error = json.loads(store.get_bytes(export_failure_key("task-1", "trial-1", "merged")))["error"]
    assert error.startswith("FileNotFoundError"), error


def test_a_build_already_stored_is_not_made_again(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    store.put_bytes(export_key("task-1", "trial-1", "merged"), b"built before")
    build_export(request("adapters/task-1/gone.tar.gz"), store=store, cache_dir=tmp_path / "models")
    assert store.get_bytes(export_key("task-1", "trial-1", "merged")) == b"built before"
    assert not store.exists(export_failure_key("task-1", "trial-1", "merged"))


def _adapter(tmp_path: Path, shapes: dict[str, tuple[int, int]], *, rank: int = 4,
             rslora: bool = False) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A PEFT adapter of random A, B on ``shapes`` ({module path: (out, in)})."""
    generator = torch.Generator().manual_seed(0)
    tensors = {path: (torch.randn(rank, d_in, generator=generator), torch.randn(d_out, rank, generator=generator))
               for path, (d_out, d_in) in shapes.items()}
    targets = sorted({path.rsplit(".", 1)[-1] for path in shapes})
    out = export_peft_adapter(tmp_path / "adapter", tensors, config=LoraConfig(rank, 8.0, 0.0, rslora),
                              target_modules=targets, base_model_name="base")
    return out, tensors


def _read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    return fields, {t.name: np.array(t.data) for t in reader.tensors}


def test_a_llama_adapter_gguf_has_llama_cpps_names_and_permuted_query_and_key_rows(tmp_path: Path) -> None:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    shapes = {"model.layers.0.self_attn.q_proj": (32, 32), "model.layers.0.self_attn.k_proj": (16, 32),
              "model.layers.1.self_attn.v_proj": (16, 32), "model.layers.1.mlp.down_proj": (32, 64),
              "lm_head": (100, 32)}
    adapter, tensors = _adapter(tmp_path, shapes)
    fields, read = _read(write_adapter_gguf(adapter, config, tmp_path / "adapter.gguf"))
    assert (fields["general.architecture"], fields["general.type"], fields["adapter.type"]) == (
        "llama", "adapter", "lora")
    assert fields["adapter.lora.alpha"] == pytest.approx(8.0)
    names = {"model.layers.0.self_attn.q_proj": "blk.0.attn_q", "model.layers.0.self_attn.k_proj": "blk.0.attn_k",
             "model.layers.1.self_attn.v_proj": "blk.1.attn_v", "model.layers.1.mlp.down_proj": "blk.1.ffn_down",
             "lm_head": "output"}
    assert set(read) == {f"{n}.weight.lora_{ab}" for n in names.values() for ab in "ab"}
    for path, name in names.items():
        a, b = tensors[path]
        np.testing.assert_array_equal(read[f"{name}.weight.lora_a"], a.numpy())  # (rank, in), as PEFT's
        got_b = torch.from_numpy(read[f"{name}.weight.lora_b"])
        if name.endswith(("attn_q", "attn_k")):
            heads = 4 if name.endswith("attn_q") else 2
            # The delta on llama.cpp's permuted weight is the permuted delta: its rows, head by head, the halves
            # interleaved (row 1 of head 0 is row d/2 of the original).
            torch.testing.assert_close(got_b @ a, permute_rows(b @ a, heads))
            half = b.shape[0] // heads // 2
            torch.testing.assert_close(got_b[1], b[half])
            assert not torch.equal(got_b, b)
        else:
            torch.testing.assert_close(got_b, b)


def test_other_architectures_keep_their_rows_and_rslora_keeps_its_scale(tmp_path: Path) -> None:
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    adapter, tensors = _adapter(tmp_path, {"model.layers.0.self_attn.q_proj": (32, 32)}, rank=16, rslora=True)
    fields, read = _read(write_adapter_gguf(adapter, config, tmp_path / "adapter.gguf"))
    assert fields["general.architecture"] == "qwen2"
    assert fields["adapter.lora.alpha"] / 16 == pytest.approx(8.0 / math.sqrt(16))  # llama.cpp scales alpha / rank
    np.testing.assert_array_equal(read["blk.0.attn_q.weight.lora_b"], tensors["model.layers.0.self_attn.q_proj"][1])
    with pytest.raises(ValueError, match="no GGUF export for architecture 'phi3'"):
        write_adapter_gguf(adapter, Phi3Config(num_hidden_layers=1), tmp_path / "phi3.gguf")


def test_a_gguf_build_of_the_tiny_model_is_stored(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    adapter, _ = _adapter(tmp_path, {"model.layers.0.self_attn.q_proj": (64, 64)})
    store.put_file("adapters/task-1/trial-1.tar.gz", tar_dir(adapter, tmp_path / "a.tar.gz", gzip=True))
    build_export(request("adapters/task-1/trial-1.tar.gz").model_copy(update={"format": "gguf"}), store=store,
                 cache_dir=MODEL_CACHE)
    assert not store.exists(export_failure_key("task-1", "trial-1", "gguf"))
    (tmp_path / "built.gguf").write_bytes(store.get_bytes(export_key("task-1", "trial-1", "gguf")))
    fields, read = _read(tmp_path / "built.gguf")
    assert fields["general.architecture"] == "llama" and set(read) == {"blk.0.attn_q.weight.lora_a",
                                                                        "blk.0.attn_q.weight.lora_b"}
