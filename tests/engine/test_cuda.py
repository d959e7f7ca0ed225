"""The engine on a GPU: bf16 base, fp32 adapters; pack == alone and PEFT agreement there too.

Skipped where there is no CUDA device (the CPU tests cover the same behaviour in fp32).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from tests.engine.factories import TINY, chat_rows, completion_rows, make_spec
from worker.engine import PackCallbacks, PackConfig, StepStats, TrialSpec, adapter_logits, load_base_model, train_pack
from worker.engine.lora import StackedLoraLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _specs() -> list[TrialSpec]:
    return [
        make_spec(
            "g1",
            target_modules=["q_proj", "v_proj", "lm_head"],
            lora_dropout=0.05,
            max_steps=16,
            train_rows=chat_rows(4),
        ),
        make_spec(
            "g2",
            target_modules=["all-linear", "lm_head"],
            learning_rate=1e-2,
            lora_rank=8,
            lora_dropout=0.1,
            batch_size=2,
            lr_schedule="cosine",
            warmup_steps=3,
            seed=7,
            max_steps=20,
            train_rows=completion_rows(4),
            val_rows=[],
        ),
    ]


def test_cuda_pack_learns_equals_alone_and_matches_peft(model_cache: Path, tmp_path: Path) -> None:
    model, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CUDA)
    assert model.dtype == torch.bfloat16 and next(model.parameters()).is_cuda

    points: list[tuple[str, int, str, float]] = []
    stats: list[StepStats] = []
    pack = train_pack(
        model, tokenizer, _specs(),
        PackConfig(base_model_name=TINY.name, export_dir=tmp_path / "pack"),
        PackCallbacks(on_point=lambda *p: points.append(p), on_step=stats.append),
    )
    assert [o.status for o in pack] == ["completed", "completed"]
    assert all(s.peak_memory_bytes is not None and s.peak_memory_bytes > 0 for s in stats)
    for trial_id in ("g1", "g2"):
        train = [loss for t, _, s, loss in points if t == trial_id and s == "train"]
        assert sum(train[-3:]) / 3 < train[0] - 2.0, f"{trial_id} did not learn: {train}"

    for spec, in_pack in zip(_specs(), pack, strict=True):
        (alone,) = train_pack(
            model, tokenizer, [spec],
            PackConfig(base_model_name=TINY.name, export_dir=tmp_path / "alone"),
            PackCallbacks(on_point=lambda *p: None),
        )
        assert in_pack.adapter_dir is not None and alone.adapter_dir is not None
        packed = load_file(str(in_pack.adapter_dir / "adapter_model.safetensors"))
        single = load_file(str(alone.adapter_dir / "adapter_model.safetensors"))
        # bf16 GEMMs of differently shaped batches round differently, and 16-20 Adam steps carry that on:
        # packed and alone agree to bf16 precision, not bit for bit (the CPU tests check 1e-5 in fp32).
        worst = max(float((packed[k] - single[k]).norm() / single[k].norm()) for k in packed)
        print(f"{spec.trial_id}: worst relative difference, packed vs alone: {worst:.2e}")
        assert worst < 5e-2, f"{spec.trial_id}: packed and alone differ by {worst:.2e} (relative norm)"

    adapter_dir = pack[0].adapter_dir
    assert adapter_dir is not None
    ids = torch.tensor(
        [
            tokenizer(
                tokenizer.apply_chat_template(chat_rows(1)[0]["messages"], tokenize=False), add_special_tokens=False
            )["input_ids"]
        ],
        device=CUDA,
    )
    engine = adapter_logits(model, adapter_dir, ids).float()
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules())
    base = model(input_ids=ids).logits.float()
    fresh, _ = load_base_model(TINY, cache_dir=model_cache, device=CUDA)
    peft_model = PeftModel.from_pretrained(fresh, adapter_dir).eval()
    with torch.no_grad():
        reference = peft_model(input_ids=ids).logits.float()
    # bf16 logits: agreement to bf16 resolution, far closer than the adapter's own effect.
    torch.testing.assert_close(engine, reference, rtol=2e-2, atol=2e-2)
    assert (engine - base).abs().max() > 0.5


@pytest.mark.parametrize("window", [None, 32])
def test_cuda_varlen_attention_equals_the_row_by_row_path(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """FlashAttention's variable-length kernel, where it runs, computes what SDPA computes row by row (with a
    sliding window too)."""
    from worker.engine.attention import attention_path, packed_attention

    torch.manual_seed(0)
    query = torch.randn(1, 8, 300, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    key = torch.randn(1, 2, 300, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    value = torch.randn(1, 2, 300, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    # Empty rows too: a step packed with static shapes may end in empty padding rows.
    bounds = torch.tensor([0, 17, 145, 145, 146, 300, 300], dtype=torch.int32, device=CUDA)
    if attention_path(query) != "varlen":
        pytest.skip("no varlen attention in this torch")
    module = torch.nn.Module()
    results = []
    for path in ("varlen", "rows"):
        monkeypatch.setenv("LORAPLANE_ATTENTION", path)
        out, _ = packed_attention(
            module, query, key, value, None, cu_seq_lens_q=bounds, max_length_q=154, sliding_window=window
        )
        grads = torch.autograd.grad(out.float().square().sum(), (query, key, value))
        results.append((out.float(), *(g.float() for g in grads)))
    for varlen, rows in zip(*results, strict=True):
        torch.testing.assert_close(varlen, rows, rtol=2e-2, atol=2e-2)


def test_cuda_fused_base_ops_compute_what_the_model_computes(model_cache: Path) -> None:
    """Liger's RMSNorm / SwiGLU / RoPE on the base model: the same logits and input gradients as HF's code,
    and ``unfuse`` gives back the bare model."""
    from worker.engine.fused import FUSED_OPS, fuse, unfuse

    model, _ = load_base_model(TINY, cache_dir=model_cache, device=CUDA)
    ids = torch.randint(0, 250, (2, 37), device=CUDA)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        inputs = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=inputs).logits.float()
        logits.square().mean().backward()
        assert inputs.grad is not None
        return logits.detach(), inputs.grad.float()

    plain = run()
    assert fuse(model, FUSED_OPS) == list(FUSED_OPS)
    fused = run()
    unfuse(model)
    assert not any("forward" in vars(m) for m in model.modules())
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(run()[0], plain[0], rtol=0, atol=0)  # unfused: bit-identical again


def test_cuda_captured_steps_train_as_eager_steps(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps replayed from CUDA graphs (capture.py) train as eager steps do, across an evict and an admit
    (empty segments, the same graphs), with dropout. (The tiny model's lm_head, 259 wide, is not one
    ``torch._grouped_mm`` takes: a pack that adapts it steps eagerly.)"""
    from worker.engine import PackEngine

    model, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CUDA)
    first, second = (dataclasses.replace(spec, target_modules=["q_proj", "v_proj", "down_proj"]) for spec in _specs())
    late = make_spec("g3", target_modules=["all-linear"], lora_rank=4, seed=3, train_rows=chat_rows(4))

    def run(mode: str) -> tuple[list[dict[str, float]], list[torch.Tensor], int]:
        monkeypatch.setenv("LORAPLANE_STEP_CAPTURE", mode)
        with PackEngine(model, tokenizer, capacity=3, max_rank=8) as engine:
            assert (engine.graphs is not None) == (mode == "auto")
            for spec in (first, second):
                engine.admit(spec)
            losses = [engine.step() for _ in range(5)]
            engine.evict(0)
            losses += [engine.step() for _ in range(3)]
            engine.admit(late)
            losses += [engine.step() for _ in range(4)]
            adapters = [t for slot in (0, 1) for pair in engine.adapter(slot).values() for t in pair]
            replays = engine.graphs.replays if engine.graphs is not None else 0
        return losses, adapters, replays

    eager_losses, eager_adapters, _ = run("off")
    captured_losses, captured_adapters, replays = run("auto")
    assert replays == 12
    for eager, captured in zip(eager_losses, captured_losses, strict=True):
        assert eager.keys() == captured.keys()
        for trial_id in eager:
            assert abs(eager[trial_id] - captured[trial_id]) <= 2e-2 * abs(eager[trial_id]), (trial_id, eager, captured)
    # bf16 GEMMs of differently padded batches round differently; Adam carries that on for a few steps.
    worst = max(float((c - e).norm() / e.norm()) for c, e in zip(captured_adapters, eager_adapters, strict=True))
    assert worst < 5e-2, f"captured and eager adapters differ by {worst:.2e} (relative norm)"
    monkeypatch.setenv("LORAPLANE_STEP_CAPTURE", "auto")
    with PackEngine(model, tokenizer, capacity=1, max_rank=8, target_modules=["q_proj", "lm_head"]) as engine:
        assert engine.graphs is None  # lm_head (259 wide) is not a shape torch._grouped_mm takes


def test_cuda_a_kept_engine_replays_its_graphs_in_the_next_pack_and_shrinks_as_trials_end(
    model_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: the second pack of the same model and shape takes the first's engine (worker/engine/keeper.py)
    and replays the graphs the first captured: no capture, every step replayed. Within a pack, a trial that
    ends takes its rows out of the step (fewer active slots, a smaller captured shape) and the others train
    as they do eagerly."""
    from worker.engine.keeper import EngineKeeper
    from worker.engine.trainer import PackTimings

    monkeypatch.setenv("LORAPLANE_STEP_CAPTURE", "auto")
    model, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CUDA)

    def specs(prefix: str) -> list[TrialSpec]:  # the short trial ends after 4 steps, the long one goes on to 10
        return [make_spec(f"{prefix}{i}", target_modules=["q_proj", "v_proj", "down_proj"], seed=i, max_steps=steps,
                          lora_rank=8, train_rows=chat_rows(4), val_rows=[]) for i, steps in enumerate((4, 10))]

    def pack(prefix: str, keeper: EngineKeeper | None) -> tuple[PackTimings, list[StepStats], dict[str, list[float]]]:
        timings, stats, losses = PackTimings(), list[StepStats](), dict[str, list[float]]()
        train_pack(
            model, tokenizer, specs(prefix),
            PackConfig(base_model_name="tiny", export_dir=tmp_path / prefix),
            PackCallbacks(on_point=lambda t, s, split, v: losses.setdefault(t[1:], []).append(v) if split == "train"
                          else None, on_step=stats.append),
            timings=timings, keeper=keeper,
        )
        return timings, stats, losses

    keeper = EngineKeeper()
    first, first_steps, _ = pack("a", keeper)
    second, second_steps, kept_losses = pack("b", keeper)
    keeper.drop()
    assert keeper.reuses == 1
    assert first.capture_s > 0 and second.capture_s == 0.0
    assert len(second_steps) == 10 and all(s.captured for s in second_steps)
    assert [s.active_slots for s in second_steps] == [2] * 4 + [1] * 6
    width = [s.tokens + s.padded_tokens for s in second_steps]
    assert width[-1] < width[0]  # the captured shape shrank with the trial that ended
    monkeypatch.setenv("LORAPLANE_STEP_CAPTURE", "off")
    _, eager_steps, eager_losses = pack("c", None)
    assert not any(s.captured for s in eager_steps)
    for trial in ("0", "1"):
        for captured, eager in zip(kept_losses[trial], eager_losses[trial], strict=True):
            assert abs(captured - eager) <= 2e-2 * abs(eager), (trial, kept_losses[trial], eager_losses[trial])


@pytest.mark.parametrize("max_graphs", [1, 2])
def test_cuda_past_max_graphs_the_least_recently_replayed_shape_makes_room(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch, max_graphs: int
) -> None:
    """A pack that goes through shapes A, B, C and back to A with room for one or two graphs captures A again
    (evicted for C), replays every step, and trains as eager steps do."""
    from worker.engine import PackEngine, capture

    model, tokenizer = load_base_model(TINY, cache_dir=model_cache, device=CUDA)

    def spec(trial_id: str, seed: int, rows: list[dict[str, str]]) -> TrialSpec:
        return make_spec(trial_id, target_modules=["q_proj", "v_proj"], lora_rank=8, seed=seed, train_rows=rows)

    def run(mode: str) -> tuple[list[dict[str, float]], int, int]:
        monkeypatch.setenv("LORAPLANE_STEP_CAPTURE", mode)
        with PackEngine(model, tokenizer, capacity=2, max_rank=8) as engine:
            losses = []
            for phase, trials in enumerate([["a", "b"], ["a"], ["c"], ["a", "b"]]):  # shapes A, B, C, A
                for slot, state in enumerate(engine.slots):
                    if state is not None and state.spec.trial_id[0] not in trials:
                        engine.evict(slot)
                kept = {state.spec.trial_id[0] for state in engine.slots if state is not None}
                for name in [t for t in trials if t not in kept]:
                    rows = completion_rows(4) if name == "c" else chat_rows(4)
                    engine.admit(spec(f"{name}{phase}", ord(name), rows))
                losses += [engine.step() for _ in range(2)]
            graphs = engine.graphs
            return losses, graphs.captures if graphs else 0, graphs.replays if graphs else 0

    monkeypatch.setattr(capture, "MAX_GRAPHS", max_graphs)
    captured, captures, replays = run("auto")
    eager, _, _ = run("off")
    assert (captures, replays) == (4, 8)
    for got, want in zip(captured, eager, strict=True):
        assert got.keys() == want.keys()
        for trial_id in want:
            assert abs(got[trial_id] - want[trial_id]) <= 2e-2 * abs(want[trial_id]), (trial_id, got, want)
