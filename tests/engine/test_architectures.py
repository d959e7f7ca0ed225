"""Every supported architecture, from a tiny random model of its real `transformers` config class saved as a
real directory: the engine's training equals PEFT + torch AdamW's, a pack trains each trial as it would alone,
and the exported adapter loads in PEFT and reproduces the engine's logits.

What each family adds to Llama: Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's sliding window, Gemma 2's
embedding scale, (1 + w) norms, sliding window and both soft caps, Gemma 3's q/k norms and local layers, Phi-3's
fused qkv_proj and gate_up_proj (the adapter sits on the fused projection, as in PEFT)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from common.architectures import target_modules_for
from tests.engine.factories import CPU, assert_rel_close, chat_rows, completion_rows, make_spec, peft_adamw_reference
from tests.model_dirs import ARCHITECTURES, tiny_model_dir
from worker.engine import (
    ModelSource,
    PackCallbacks,
    PackConfig,
    PackEngine,
    TrialSpec,
    adapter_logits,
    load_base_model,
    train_pack,
)
from worker.engine.data import encode_rows
from worker.engine.lora import resolve_target_modules
from worker.engine.store import ModuleTensors

Model = tuple[PreTrainedModel, PreTrainedTokenizerBase]
FAMILIES = [a for a in ARCHITECTURES if a != "llama"]  # Llama: tests/engine/test_engine.py and test_export.py
# Rows longer than the families' 16-token sliding window.
ROWS = chat_rows(6)
# Relative tolerance of trained adapters and losses. Bit-equal on a 2-core host; on a 16-core one the CPU BLAS blocks
# differently for a pack's token count than for one trial's (or PEFT's padded batch), and the tiny Gemmas amplify
# those last bits most: 1.4e-5 to 2.4e-5 measured there, where a 1e-7 perturbation of the base weights moves their
# adapters by 1e-4 after five AdamW steps (the others': 1e-6 to 3e-5).
TOLERANCE = {"gemma2": 1e-4, "gemma3_text": 1e-4}


def _tolerance(architecture: str) -> float:
    return TOLERANCE.get(architecture, 1e-5)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("architectures")
    return {a: tiny_model_dir(a, root / a) for a in FAMILIES}


def _load(model_dirs: dict[str, Path], architecture: str) -> Model:
    source = ModelSource(name=f"tiny-{architecture}", kind="hf", path=str(model_dirs[architecture]))
    return load_base_model(source, cache_dir=Path("/nonexistent"), device=CPU)


def _reference(model_dirs: dict[str, Path], architecture: str) -> Model:
    """The model for PEFT, on transformers' eager attention: the definition. (transformers 5.17 picks SDPA for
    Gemma 2 by default, which drops its attention soft cap.)"""
    model, tokenizer = _load(model_dirs, architecture)
    model.set_attn_implementation("eager")
    return model, tokenizer


def _engine(model: Model, specs: list[TrialSpec]) -> PackEngine:
    paths = sorted({p for s in specs for p in resolve_target_modules(model[0], s.target_modules)})
    return PackEngine(*model, capacity=len(specs), max_rank=max(s.lora_rank for s in specs), target_modules=paths)


def _train(model: Model, specs: list[TrialSpec], steps: int) -> tuple[dict[str, ModuleTensors], dict[str, list[float]]]:
    curves: dict[str, list[float]] = {s.trial_id: [] for s in specs}
    with _engine(model, specs) as engine:
        slots = {s.trial_id: engine.admit(s) for s in specs}
        for _ in range(steps):
            for trial_id, loss in engine.step().items():
                curves[trial_id].append(loss)
        return {tid: engine.adapter(slot) for tid, slot in slots.items()}, curves


@pytest.mark.parametrize("architecture", FAMILIES)
def test_training_matches_peft_with_torch_adamw(model_dirs: dict[str, Path], architecture: str) -> None:
    targets = list(target_modules_for(architecture) or ())
    spec = make_spec("p", target_modules=targets, batch_size=3, learning_rate=1e-2, weight_decay=0.05,
                     max_steps=4, train_rows=ROWS)
    model = _load(model_dirs, architecture)
    with _engine(model, [spec]) as engine:
        slot = engine.admit(spec)
        init = engine.adapter(slot)
        losses = [engine.step()["p"] for _ in range(4)]
        trained = engine.adapter(slot)

    reference_model, tokenizer = _reference(model_dirs, architecture)
    peft_model, reference = peft_adamw_reference(reference_model, tokenizer, spec, init, 4)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    assert len(params) == 2 * len(init) > 0
    examples = encode_rows(spec.train_rows, tokenizer, spec.max_seq_len)
    assert max(len(e.input_ids) for e in examples) > 16  # past the sliding window
    torch.testing.assert_close(losses, reference, rtol=_tolerance(architecture), atol=1e-6)
    for path, (a, b) in trained.items():
        layer = peft_model.base_model.model.get_submodule(path)
        assert_rel_close(a, layer.lora_A["default"].weight.detach(), rel=10 * _tolerance(architecture))
        assert_rel_close(b, layer.lora_B["default"].weight.detach(), rel=10 * _tolerance(architecture))


@pytest.mark.parametrize("architecture", FAMILIES)
def test_a_pack_trains_each_trial_as_it_would_alone(model_dirs: dict[str, Path], architecture: str) -> None:
    names = target_modules_for(architecture) or ()
    specs = [
        make_spec("a", target_modules=[names[0], names[-1]], train_rows=ROWS),
        make_spec("b", target_modules=["all-linear"], lora_rank=8, lora_alpha=16.0, lora_dropout=0.1, batch_size=2,
                  seed=7, train_rows=completion_rows(4)),
    ]  # fmt: skip
    model = _load(model_dirs, architecture)
    packed, curves = _train(model, specs, 5)
    for spec in specs:
        alone, losses = _train(model, [spec], 5)
        for got, want in zip(packed[spec.trial_id].values(), alone[spec.trial_id].values(), strict=True):
            assert_rel_close(got[0], want[0], rel=_tolerance(architecture))
            assert_rel_close(got[1], want[1], rel=_tolerance(architecture))
        rtol = _tolerance(architecture)
        torch.testing.assert_close(curves[spec.trial_id], losses[spec.trial_id], rtol=rtol, atol=1e-6)
    assert all(b.abs().max() > 1e-3 for adapter in packed.values() for _, b in adapter.values())  # they trained


@pytest.mark.parametrize("architecture", FAMILIES)
def test_the_export_loads_in_peft_and_reproduces_the_engines_logits(
    model_dirs: dict[str, Path], architecture: str, tmp_path: Path
) -> None:
    model = _load(model_dirs, architecture)
    spec = make_spec("t", target_modules=["all-linear"], max_steps=6, lora_dropout=0.1, train_rows=ROWS)
    base_path = str(model_dirs[architecture])
    (outcome,) = train_pack(
        *model, [spec],
        PackConfig(base_model_name=base_path, export_dir=tmp_path),
        PackCallbacks(on_point=lambda *p: None),
    )
    assert outcome.status == "completed" and outcome.adapter_dir is not None
    config = json.loads((outcome.adapter_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(target_modules_for(architecture) or ())
    assert config["base_model_name_or_path"] == base_path

    tokenizer = model[1]
    text = tokenizer.apply_chat_template(ROWS[5]["messages"], tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # a right-padded row too
    engine = adapter_logits(model[0], outcome.adapter_dir, ids, mask)
    base = model[0](input_ids=ids, attention_mask=mask).logits

    peft_model = PeftModel.from_pretrained(_reference(model_dirs, architecture)[0], outcome.adapter_dir).eval()
    with torch.no_grad():
        reference = peft_model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(engine, reference, atol=1e-5, rtol=1e-5)
    assert (engine - base).abs().max() > 1e-3, "the trained adapter should change the output"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", FAMILIES)
def test_cuda_training_follows_the_fp32_cpu_run(model_dirs: dict[str, Path], architecture: str) -> None:
    """On the GPU each family runs its fast path (bf16, varlen attention with its window, Liger's kernels where
    they apply, the rows path where the scores are soft-capped): its losses follow the exact fp32 CPU run's."""
    spec = make_spec("g", target_modules=["all-linear"], batch_size=3, learning_rate=1e-2, max_steps=4, train_rows=ROWS)
    losses = {}
    for device in (CPU, torch.device("cuda")):
        source = ModelSource(name=architecture, kind="hf", path=str(model_dirs[architecture]))
        model = load_base_model(source, cache_dir=Path("/nonexistent"), device=device)
        with _engine(model, [spec]) as engine:
            engine.admit(spec)
            losses[device.type] = [engine.step()["g"] for _ in range(4)]
    torch.testing.assert_close(losses["cuda"], losses["cpu"], rtol=3e-2, atol=3e-2)
