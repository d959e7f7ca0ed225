"""PackEngine: a pack trains every trial exactly as it would alone (also across evict / admit), matches
PEFT + torch.optim.AdamW, and reports its steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import (
    CPU,
    assert_rel_close,
    chat_rows,
    completion_rows,
    make_spec,
    peft_adamw_reference,
)
from worker.engine import PackEngine, TrialSpec, feed
from worker.engine.batch import SlotRows, cut_forwards
from worker.engine.data import BatchSampler, encode_rows
from worker.engine.generation import greedy_matches
from worker.engine.lora import resolve_target_modules
from worker.engine.passes import ModelPasses
from worker.engine.spec import trial_seed
from worker.engine.store import ModuleTensors

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]

# Deliberately different: targets, rank, alpha, rsLoRA, dropout, batch size, schedule, decay, clipping, data.
MIXED: dict[str, dict[str, Any]] = {
    "a": {"target_modules": ["q_proj", "v_proj", "lm_head"], "lora_dropout": 0.05, "train_rows": chat_rows(4)},
    "b": {
        "target_modules": ["all-linear"],
        "lora_rank": 8,
        "lora_alpha": 16.0,
        "lora_dropout": 0.1,
        "batch_size": 2,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "weight_decay": 0.01,
        "max_grad_norm": 0.5,
        "beta2": 0.99,
        "seed": 7,
        "train_rows": completion_rows(4),
    },
    "c": {
        "target_modules": ["o_proj", "down_proj"],
        "lora_rank": 2,
        "use_rslora": True,
        "lora_dropout": 0.2,
        "batch_size": 3,
        "lr_schedule": "linear",
        "seed": 3,
    },
    "d": {"target_modules": ["k_proj", "up_proj"], "lora_rank": 6, "batch_size": 1, "eps": 1e-6, "seed": 11},
}


def _engine(tiny: Tiny, specs: list[TrialSpec], capacity: int | None = None) -> PackEngine:
    model, tokenizer = tiny
    paths = sorted({p for s in specs for p in resolve_target_modules(model, s.target_modules)})
    return PackEngine(model, tokenizer, capacity=capacity or len(specs),
                      max_rank=max(s.lora_rank for s in specs), target_modules=paths)


def _alone(tiny: Tiny, spec: TrialSpec, steps: int) -> tuple[ModuleTensors, list[float]]:
    with _engine(tiny, [spec]) as engine:
        slot = engine.admit(spec)
        losses = [engine.step()[spec.trial_id] for _ in range(steps)]
        return engine.adapter(slot), losses


def _assert_same(packed: ModuleTensors, alone: ModuleTensors) -> None:
    assert packed.keys() == alone.keys()
    for path in packed:
        for got, want in zip(packed[path], alone[path], strict=True):
            assert_rel_close(got, want)


def test_a_pack_trains_each_trial_as_it_would_alone(tiny: Tiny) -> None:
    specs = [make_spec(tid, **MIXED[tid]) for tid in ("a", "b", "c")]
    curves: dict[str, list[float]] = {s.trial_id: [] for s in specs}
    with _engine(tiny, specs) as engine:
        slots = {s.trial_id: engine.admit(s) for s in specs}
        for _ in range(6):
            for trial_id, loss in engine.step().items():
                curves[trial_id].append(loss)
        packed = {tid: engine.adapter(slot) for tid, slot in slots.items()}
        assert engine.last_stats is not None and engine.last_stats.active_slots == 3
    for spec in specs:
        adapter, losses = _alone(tiny, spec, 6)
        _assert_same(packed[spec.trial_id], adapter)
        torch.testing.assert_close(curves[spec.trial_id], losses, rtol=1e-5, atol=1e-6)
        assert losses[-1] < losses[0] - 0.2, f"{spec.trial_id} did not learn: {losses}"


def test_evict_zeroes_a_slot_and_a_trial_admitted_mid_run_trains_as_alone(tiny: Tiny) -> None:
    specs = [make_spec(tid, **MIXED[tid]) for tid in ("a", "b", "c")]
    late = make_spec("d", **MIXED["d"])
    with _engine(tiny, [*specs, late], capacity=3) as engine:
        slots = {s.trial_id: engine.admit(s) for s in specs}
        with pytest.raises(ValueError, match="no free slot"):
            engine.admit(late)
        for _ in range(3):
            engine.step()
        freed = slots.pop("b")
        engine.evict(freed)
        store, optimizer = engine.store, engine.optimizer
        for matrix in (store.weights, store.grads, optimizer.exp_avg, optimizer.exp_avg_sq):
            assert not matrix[freed].any()
        assert not store.scales[:, freed].any() and optimizer.steps[freed] == 0 and engine.slots[freed] is None
        assert engine.admit(late) == freed
        for _ in range(4):
            assert set(engine.step()) == {"a", "c", "d"}
        packed = {tid: engine.adapter(slot) for tid, slot in slots.items()}
        packed["d"] = engine.adapter(freed)
    for spec, steps in [(specs[0], 7), (specs[2], 7), (late, 4)]:
        _assert_same(packed[spec.trial_id], _alone(tiny, spec, steps)[0])


def test_one_trial_matches_peft_with_torch_adamw(tiny: Tiny, fresh_tiny: Tiny) -> None:
    spec = make_spec(
        "p", target_modules=["q_proj", "v_proj", "down_proj"], batch_size=2, weight_decay=0.05, beta1=0.8, beta2=0.99,
        max_steps=5, learning_rate=1e-2,
    )
    with _engine(tiny, [spec]) as engine:
        slot = engine.admit(spec)
        init = engine.adapter(slot)
        losses = [engine.step()["p"] for _ in range(5)]
        trained = engine.adapter(slot)

    peft_model, reference = peft_adamw_reference(*fresh_tiny, spec, init, 5)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6)
    for path, (a, b) in trained.items():
        layer = peft_model.base_model.model.get_submodule(path)
        torch.testing.assert_close(a, layer.lora_A["default"].weight, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b, layer.lora_B["default"].weight, rtol=1e-4, atol=1e-6)
        assert b.abs().max() > 1e-3  # it trained


def test_step_stats_report_real_tokens_and_no_padding(tiny: Tiny) -> None:
    _, tokenizer = tiny
    specs = [make_spec("s1", batch_size=1, train_rows=completion_rows(4)), make_spec("s2", batch_size=2, seed=5)]
    with _engine(tiny, specs) as engine:
        for spec in specs:
            engine.admit(spec)
        engine.step()
        stats = engine.last_stats
    assert stats is not None
    lengths, targets = [], 0
    for spec in specs:  # the rows each trial's own sampler draws first
        examples = encode_rows(spec.train_rows, tokenizer, spec.max_seq_len)
        for i in BatchSampler(len(examples), spec.batch_size, trial_seed(spec.seed, "data")).next_indices():
            lengths.append(len(examples[i].input_ids))
            targets += examples[i].n_targets
    assert (stats.step, stats.active_slots, stats.tokens, stats.target_tokens) == (1, 2, sum(lengths), targets)
    assert len(set(lengths)) > 1  # rows of different lengths ...
    assert stats.padded_tokens == 0 and stats.padded_fraction == 0  # ... packed end to end: no padding on the CPU
    assert stats.seconds > 0 and stats.peak_memory_bytes is None


def test_the_next_batch_is_packed_ahead_and_dropped_when_the_pack_changes(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [make_spec("a"), make_spec("b", seed=2)]
    packed: list[list[int]] = []
    real_pack = ModelPasses.pack

    def recording_pack(passes: ModelPasses, parts: Any, **kwargs: Any) -> Any:
        packed.append([p.slot for p in parts])
        return real_pack(passes, parts, **kwargs)

    monkeypatch.setattr(ModelPasses, "pack", recording_pack)
    with _engine(tiny, specs) as engine:
        for spec in specs:
            engine.admit(spec)
        for _ in range(3):
            engine.step()
        # The first step packs its own batch; every step packs the next one while the device works.
        assert packed == [[0, 1]] * 4
        engine.evict(1)
        engine.step()
        assert packed[4:] == [[0], [0]]  # the batch packed ahead for slots 0 and 1 went unused


def test_trials_with_the_same_rows_tokenise_them_once(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.engine.pack_engine as engine_module

    calls: list[int] = []
    real = engine_module.encode_rows

    def counting(rows: Any, tokenizer: Any, max_seq_len: int) -> Any:
        calls.append(len(rows))
        return real(rows, tokenizer, max_seq_len)

    monkeypatch.setattr(engine_module, "encode_rows", counting)
    shared = chat_rows(6)
    specs = [make_spec(f"t{i}", seed=i, train_rows=list(shared), val_rows=[]) for i in range(3)]
    specs.append(make_spec("other", train_rows=completion_rows(4), val_rows=[]))
    with _engine(tiny, specs) as engine:
        for spec in specs:
            engine.admit(spec)
        engine.step()
    # One encoding of the shared rows (equal content, distinct lists), one of the other trial's, one empty val.
    assert sorted(calls) == [0, 4, 6]


def test_the_triton_backend_trains_a_mixed_pack_as_the_torch_backend(tiny: Tiny) -> None:
    """The engine on the Triton kernels (fp32; the interpreter on CPU, the GPU where there is one): same
    losses and adapters as on the torch path, with mixed ranks, targets, batch sizes and dropouts (lm_head
    included; on the GPU rows are padded to 64, and the kernels skip the padding)."""
    from kernels import get_backend, set_backend
    from kernels.lora_linear import resolve_backend

    model = tiny[0]
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    specs = [make_spec(tid, **MIXED[tid]) for tid in ("a", "b", "c")]
    results: dict[str, tuple[dict[str, ModuleTensors], list[dict[str, float]]]] = {}
    for backend in ("torch", "triton"):
        set_backend(backend)  # type: ignore[arg-type]
        model.to(device)
        try:
            with _engine(tiny, specs) as engine:
                assert resolve_backend(engine.store.compute) == backend
                slots = {s.trial_id: engine.admit(s) for s in specs}
                losses = [engine.step() for _ in range(2)]
                adapters = {tid: {p: (a.cpu(), b.cpu()) for p, (a, b) in engine.adapter(slot).items()}
                            for tid, slot in slots.items()}
                results[backend] = (adapters, losses)
        finally:
            set_backend("auto")
            model.to(CPU)
    assert get_backend() == "auto"
    # Not bit-equal: the kernels sum in another order, and AdamW's m / sqrt(v) magnifies that on weights whose
    # gradient is near zero. A wrong sign or a missed slot would differ by ~2 x lr (1e-3 and more).
    for trial_id, adapter in results["torch"][0].items():
        for path, tensors in adapter.items():
            for got, want in zip(results["triton"][0][trial_id][path], tensors, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
    for got, want in zip(results["triton"][1], results["torch"][1], strict=True):
        assert got.keys() == want.keys()
        torch.testing.assert_close([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=1e-5, atol=1e-6)


def test_greedy_matches_is_greedy_decoding_of_every_target_token(tiny: Tiny) -> None:
    """Rows whose completion is the model's own argmax continuation match; one token off and a row fails."""
    from worker.engine.data import IGNORE_INDEX, Example

    model, tokenizer = tiny
    spec = make_spec("a", train_rows=completion_rows(4))
    prompts = [[5, 9, 14, 3], [7, 7, 2, 11, 4, 8]]
    examples = []
    for prompt in prompts:  # before the engine takes the model over (it routes attention its own way)
        ids = list(prompt)
        for _ in range(3):  # the base model's own greedy continuation, 3 tokens
            with torch.no_grad():
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        examples.append(Example(ids, [IGNORE_INDEX] * len(prompt) + ids[len(prompt):]))
    with _engine(tiny, [spec]) as engine:
        slot = engine.admit(spec)  # B = 0: the adapter does not change the base model's predictions yet
        assert greedy_matches(engine, slot, examples) == [True, True]
        wrong = examples[1].labels[:-1] + [(examples[1].labels[-1] + 1) % model.config.vocab_size]
        off = [examples[0], Example(examples[1].input_ids[:-1] + [wrong[-1]], wrong)]
        assert greedy_matches(engine, slot, off) == [True, False]
        assert greedy_matches(engine, slot, off, batch_size=1) == [True, False]
        assert greedy_matches(engine, slot, []) == []


def test_validation_of_many_slots_in_shared_forwards_equals_each_slot_alone(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.engine import validation

    specs = [
        make_spec("v1", seed=1),
        make_spec("v2", seed=2, lora_rank=8, val_rows=chat_rows(6)),
        make_spec("v3", seed=3, val_rows=[]),
    ]
    with _engine(tiny, specs) as engine:
        slots = [engine.admit(s) for s in specs]
        for _ in range(3):
            engine.step()
        alone = {slot: validation.evaluate(engine, slot) for slot in slots}
        # A small token budget cuts the validation rows into several forwards, some shared by two slots.
        monkeypatch.setattr(validation, "EVAL_MAX_TOKENS", 150)
        forwards = cut_forwards([(s, engine.state(s).val) for s in slots], 150)
        assert len(forwards) > 2 and any(len({p.slot for p in parts}) > 1 for parts in forwards)
        together = validation.evaluate_slots(engine, slots)
    assert together[slots[2]] is None and alone[slots[2]] is None
    for slot in slots[:2]:
        value, reference = together[slot], alone[slot]
        assert value is not None and reference is not None
        assert value == pytest.approx(reference, rel=1e-6)
    assert alone[slots[0]] != pytest.approx(alone[slots[1]], rel=1e-3)  # different trials, different losses


def test_cut_forwards_keep_every_row_once_in_order_within_the_token_budget() -> None:
    from worker.engine.data import Example

    def rows(*lengths: int) -> list[Example]:
        return [Example([1] * n, [1] * n) for n in lengths]

    a, b = rows(4, 4, 4), rows(10, 3)
    forwards = cut_forwards([(0, a), (1, b), (2, [])], max_tokens=9)
    sizes = [[(p.slot, [len(e.input_ids) for e in p.examples]) for p in parts] for parts in forwards]
    assert sizes == [[(0, [4, 4])], [(0, [4])], [(1, [10])], [(1, [3])]]  # a 10-token row goes alone
    assert cut_forwards([(0, a), (1, b)], max_tokens=100) == [[SlotRows(0, a), SlotRows(1, b)]]


def test_step_stats_say_where_the_host_time_went(tiny: Tiny) -> None:
    """The first step builds its batch itself (on its critical path); the next ones use the batch prefetched
    while the device worked on the step before."""
    specs = [make_spec("h1"), make_spec("h2", seed=5, batch_size=2)]
    with _engine(tiny, specs) as engine:
        for spec in specs:
            engine.admit(spec)
        stats = []
        for _ in range(3):
            engine.step()
            assert engine.last_stats is not None
            stats.append(engine.last_stats)
    assert stats[0].data_s > 0
    assert [s.data_s for s in stats[1:]] == [0.0, 0.0]  # prefetched
    assert all(s.prefetch_s > 0 and 0 <= s.sync_wait_s <= s.seconds for s in stats)


def test_a_batch_with_static_shapes_trains_as_the_packed_batch(tiny: Tiny) -> None:
    """What a step replayed from a CUDA graph computes on (capture.py): the stream and the targets padded to
    their buckets, one LoRA segment per slot (an idle one included): the same losses and gradients."""
    specs = [make_spec(tid, **MIXED[tid]) for tid in ("a", "b", "c")]  # dropout, lm_head, rsLoRA among them
    with _engine(tiny, specs, capacity=4) as engine:
        for spec in specs:
            engine.admit(spec)
        parts, _ = feed.draw(engine.slots, engine._fail)
        results = []
        for static_shapes in (False, True):
            batch = engine.passes.pack(parts, static_shapes=static_shapes)
            engine.store.grads.zero_()
            results.append((engine.passes.forward_backward(batch), engine.store.grads.clone(), batch))
        (dynamic_losses, dynamic_grads, dynamic), (static_losses, static_grads, static) = results
        padding = static.input_ids.shape[1] - dynamic.input_ids.shape[1]
        assert padding > 0  # the tiny model's rows leave a gap to their bucket: the idle slot 3 holds it
        assert static.routing.meta.slot_ids == (0, 1, 2, 3) and static.routing.meta.lengths[3] == padding
        assert static.targets.labels.shape[0] >= dynamic.targets.labels.shape[0]
        torch.testing.assert_close(static_losses, dynamic_losses, rtol=1e-6, atol=1e-7)
        assert_rel_close(static_grads, dynamic_grads)
