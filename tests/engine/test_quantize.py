"""4-bit bases (issue 36, worker/engine/quantize.py) on the tiny model, on the CPU as on a GPU: its linear layers in
NF4 take about a quarter of their bf16 bytes; a pack on the NF4 base trains as the pack on the full base does within a
stated tolerance; the merged export de-quantises the base the adapter was trained on and gives the engine's logits; a
base in a safetensors directory loads straight into NF4, tensor by tensor, the same as loaded whole and quantised."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from common.messages import ExportRequest, ModelSourceFields
from tests.engine.factories import CPU, TINY, make_spec
from worker.engine import PackCallbacks, PackConfig, adapter_logits, load_base_model, train_pack
from worker.engine.base_model import ModelSource, materialize_tiny_llama
from worker.engine.quantize import dequantize, is_quantized, load_nf4_streamed, quantize_nf4, tensor_bytes
from worker.exports import merge_adapter

NF4 = dataclasses.replace(TINY, quantization="nf4")


def _linears(model: PreTrainedModel) -> list[nn.Linear]:
    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]


def _losses(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> list[float]:
    losses: list[float] = []
    train_pack(model, tokenizer, [make_spec("t1", max_steps=8, eval_interval=4)],
               PackConfig(base_model_name="tiny-random-llama", export_dir=out),
               PackCallbacks(on_point=lambda trial_id, step, split, loss: losses.append(loss)
                             if split == "train" else None))
    return losses


def test_an_nf4_base_holds_a_quarter_of_bf16_and_trains_as_the_full_base(model_cache: Path, tmp_path: Path) -> None:
    full, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CPU)
    quantized, _ = load_base_model(NF4, cache_dir=model_cache, device=CPU)
    layers = _linears(quantized)
    assert layers and all(is_quantized(m.weight) for m in layers)  # every projection, the output head left alone
    assert not is_quantized(quantized.get_output_embeddings().weight)
    nf4 = sum(tensor_bytes(m) for m in layers)
    bf16 = sum(m.weight.numel() * 2 for m in _linears(full))
    assert 0.24 < nf4 / bf16 < 0.30, nf4 / bf16  # 4 bits and the blocks' scales, against 16 bits
    # The same trial on both bases: its train losses within 2% at every step (NF4's rounding of the frozen weights).
    reference, on_nf4 = _losses(full, tokenizer, tmp_path / "full"), _losses(quantized, tokenizer, tmp_path / "nf4")
    assert len(reference) == len(on_nf4) == 8
    for a, b in zip(reference, on_nf4, strict=True):
        assert abs(a - b) / a < 0.02, (reference, on_nf4)
    assert on_nf4 != reference  # it did run on the quantised weights


def test_the_merged_export_of_an_nf4_base_is_the_dequantised_base_plus_the_adapter(model_cache: Path,
                                                                                  tmp_path: Path) -> None:
    quantized, tokenizer = load_base_model(NF4, cache_dir=model_cache, device=CPU)
    spec = make_spec("t1", max_steps=4, eval_interval=2, learning_rate=0.05)
    train_pack(quantized, tokenizer, [spec], PackConfig(base_model_name="tiny-random-llama", export_dir=tmp_path),
               PackCallbacks(on_point=lambda *a: None))
    adapter = tmp_path / "t1"
    request = ExportRequest(task_id="task-1", trial_id="t1", adapter_key="unused",
                            base_model=ModelSourceFields(name="tiny-random-llama", kind="tiny-random-llama",
                                                         quantization="nf4"))
    merged_dir = merge_adapter(request, adapter_dir=adapter, out_dir=tmp_path / "merged", cache_dir=model_cache)
    assert "quantization_config" not in json.loads((merged_dir / "config.json").read_text())  # a plain model
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    ids = tokenizer(["3 plus 4 is 7", "the cat sat"], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = adapter_logits(quantized, adapter, ids["input_ids"], ids["attention_mask"])
        got = merged(**ids).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # Merged into the checkpoint's own weights instead (what a merge that ignores the 4 bits does), it differs.
    full, _ = load_base_model(TINY, cache_dir=model_cache, device=CPU)
    assert dequantize(full) == 0  # nothing quantised there
    with torch.no_grad():
        wrong = adapter_logits(full, adapter, ids["input_ids"], ids["attention_mask"])
    assert (wrong - want).abs().max() > 10 * (got - want).abs().max()


def test_a_directory_base_loads_straight_into_nf4_as_loaded_whole_and_quantised(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kind "hf" in NF4 never builds the bf16 base whole (a 70B base would not fit the device): the model is made on
    the meta device and each weight read from its file and quantised in turn. Same codes, same scales, same logits
    as the whole load quantised after."""
    directory = materialize_tiny_llama(model_cache / "tiny-random-llama", TINY.tokenizer)  # type: ignore[arg-type]
    source = ModelSource(name="tiny-hf", kind="hf", path=str(directory), quantization="nf4")
    whole, tokenizer = load_base_model(dataclasses.replace(source, quantization=None), cache_dir=model_cache,
                                       device=CPU)
    whole_layers = sum(1 for m in whole.modules() if isinstance(m, nn.Linear)) - 1  # all but the output head
    assert quantize_nf4(whole) == whole_layers

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the base was loaded whole")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    streamed, _ = load_base_model(source, cache_dir=model_cache, device=CPU)
    ours, theirs = dict(streamed.named_parameters()), dict(whole.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        if is_quantized(param):
            for part in ("quantized_data", "quantized_scalers", "quantization_factor"):
                assert torch.equal(getattr(param, part), getattr(theirs[name], part)), (name, part)
        else:
            assert not is_quantized(theirs[name]) and torch.equal(param, theirs[name]), name
    ids = tokenizer(["3 plus 4 is 7"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, whole(ids).logits, rtol=0, atol=0)
    assert load_nf4_streamed(model_cache, dtype=torch.float32, device=CPU) is None  # no safetensors there
