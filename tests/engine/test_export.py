"""PEFT export: the files, their format, atomic replacement, and PEFT reproducing the engine's logits."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from common.artifacts import LocalArtifactStore
from tests.engine.factories import chat_rows, make_spec
from worker.engine import PackCallbacks, PackConfig, adapter_logits, export_peft_adapter, read_peft_adapter, train_pack
from worker.engine.export import flat_peft_tensors, peft_files
from worker.engine.lora import LoraConfig, StackedLoraLinear
from worker.pack_runner import store_tar, untar

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def _train_one(tiny: Tiny, out: Path, **overrides: object) -> Path:
    spec = make_spec("t1", max_steps=8, lora_rank=4, lora_alpha=16.0, lora_dropout=0.1, **overrides)
    (outcome,) = train_pack(
        *tiny, [spec],
        PackConfig(base_model_name="tiny-random-llama", export_dir=out),
        PackCallbacks(on_point=lambda *p: None),
    )
    assert outcome.status == "completed" and outcome.adapter_dir == out / "t1"
    return outcome.adapter_dir


@pytest.mark.parametrize(
    ("targets", "peft_targets", "n_layers", "rslora"),
    [
        (["q_proj", "v_proj"], ["q_proj", "v_proj"], 4, False),
        (["q_proj", "v_proj"], ["q_proj", "v_proj"], 4, True),
        (["all-linear"], ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], 14, False),
        (["layers.1.mlp.down_proj", "lm_head"], ["lm_head", "model.layers.1.mlp.down_proj"], 2, True),
    ],
)
def test_peft_loads_the_adapter_and_reproduces_engine_logits(
    tiny: Tiny,
    fresh_tiny: Tiny,
    tmp_path: Path,
    targets: list[str],
    peft_targets: list[str],
    n_layers: int,
    rslora: bool,
) -> None:
    model, tokenizer = tiny
    adapter_dir = _train_one(tiny, tmp_path, target_modules=targets, use_rslora=rslora)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == peft_targets
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["use_rslora"]) == (4, 16, 0.1, rslora)

    text = tokenizer.apply_chat_template(chat_rows(1)[0]["messages"], tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # a right-padded row too
    engine = adapter_logits(model, adapter_dir, ids, mask)
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules())  # helper cleaned up
    base = model(input_ids=ids, attention_mask=mask).logits

    peft_model = PeftModel.from_pretrained(fresh_tiny[0], adapter_dir).eval()
    n_lora = sum(1 for name, _ in peft_model.named_modules() if name.endswith(".lora_A.default"))
    assert n_lora == n_layers
    with torch.no_grad():
        reference = peft_model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(engine, reference, atol=1e-5, rtol=1e-5)
    assert (engine - base).abs().max() > 1e-2, "the trained adapter should change the output"


def test_export_format_and_atomic_replacement(tmp_path: Path) -> None:
    out = tmp_path / "trial-9"
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.arange(8.0).reshape(4, 2)
    tensors = {"model.layers.0.self_attn.q_proj": (a, b)}
    export_peft_adapter(
        out, tensors, config=LoraConfig(2, 3.5, 0.0), target_modules=["q_proj"], base_model_name="base-x"
    )
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "base-x",
        "r": 2,
        "lora_alpha": 3.5,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj"],
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
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == [
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        ]
    read_config, read_tensors = read_peft_adapter(out)
    assert read_config == LoraConfig(2, 3.5, 0.0)
    torch.testing.assert_close(read_tensors["model.layers.0.self_attn.q_proj"][1], b)

    # Re-export (a redelivered task) replaces the directory and leaves no temp dirs behind.
    export_peft_adapter(
        out, {"lm_head": (a, b)}, config=LoraConfig(2, 2.0, 0.0), target_modules=["lm_head"], base_model_name="base-x"
    )
    assert list(read_peft_adapter(out)[1]) == ["lm_head"]
    assert [p.name for p in tmp_path.iterdir()] == ["trial-9"]


def test_adapter_files_stored_as_one_tar_unpack_to_the_directory(tmp_path: Path) -> None:
    """An adapter checkpoint goes into the store as a tar written in one pass (`PeftFiles.write_tar`, the worker's
    `store_tar`): tarfile reads it, and it holds byte for byte what the directory export writes."""
    tensors = {f"model.layers.{i}.mlp.up_proj": (torch.randn(3, 5), torch.randn(7, 3)) for i in range(2)}
    shapes, flat = flat_peft_tensors(tensors)
    files = peft_files(shapes, flat, config=LoraConfig(3, 6.0, 0.0), target_modules=["up_proj"],
                       base_model_name="base-x")
    directory = files.write_dir(tmp_path / "dir")
    store = LocalArtifactStore(tmp_path / "store")
    size = store_tar(store, "adapter-checkpoints/t/x/step-000000004.tar", files)
    assert size == store.path("adapter-checkpoints/t/x/step-000000004.tar").stat().st_size
    assert size % tarfile.BLOCKSIZE == 0 and size > files.size
    unpacked = untar(store, "adapter-checkpoints/t/x/step-000000004.tar", tmp_path / "unpacked")
    assert sorted(p.name for p in unpacked.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (unpacked / name).read_bytes() == (directory / name).read_bytes()
    torch.testing.assert_close(read_peft_adapter(unpacked)[1]["model.layers.1.mlp.up_proj"][1],
                               tensors["model.layers.1.mlp.up_proj"][1])
    assert [p.name for p in store.path("adapter-checkpoints/t/x").iterdir()] == ["step-000000004.tar"]  # no temp left
