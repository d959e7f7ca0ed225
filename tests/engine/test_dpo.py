"""DPO (worker/engine/dpo.py, issue 36): a preference row as the two sequences the model scores, the loss of a batch
of pairs against what the DPO paper derives (its value where the policy is the reference, its gradient) and the
label-smoothed and IPO forms; then training: a pack of DPO trials (with an SFT trial beside them) trains each exactly
as alone, the reference pass runs once per pair however many trials and epochs read it, and a pack reports each DPO
trial's reward metrics and, judged by reward accuracy, its best adapter's. tests/engine/test_dpo_trl.py checks the
training against TRL's DPOTrainer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import assert_rel_close, make_spec, pack_arguments
from worker.engine import Evaluation, PackEngine, TrialSpec, train_pack
from worker.engine.batch import SlotRows
from worker.engine.data import IGNORE_INDEX, Example, encode_prompt, encode_row
from worker.engine.dpo import PREFERENCE_SPLITS, REWARD_ACCURACY, dpo_terms, encode_preference_row
from worker.engine.lora import resolve_target_modules
from worker.engine.spec import DpoObjective
from worker.engine.store import ModuleTensors
from worker.engine.validation import evaluate_slots

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def _targets(example_labels: list[int]) -> list[int]:
    return [label for label in example_labels if label != IGNORE_INDEX]


def test_a_text_row_is_the_prompt_followed_by_each_answer(tiny: Tiny) -> None:
    _, tokenizer = tiny
    row = {"prompt": "2 plus 2 is", "chosen": " 4", "rejected": " 5, or so"}
    pair = encode_preference_row(row, tokenizer, 64)
    assert pair is not None
    for example, answer in ((pair.chosen, row["chosen"]), (pair.rejected, row["rejected"])):
        ids, labels = encode_row({"prompt": row["prompt"], "completion": answer}, tokenizer)
        assert (example.input_ids, example.labels) == (ids, labels)  # as SFT encodes a prompt and completion
    prompt = encode_prompt(tokenizer, prompt=row["prompt"])
    assert pair.chosen.input_ids[:len(prompt)] == pair.rejected.input_ids[:len(prompt)] == prompt
    assert pair.chosen.labels[:len(prompt)] == [IGNORE_INDEX] * len(prompt)  # only the answers are scored
    # An answer truncated away leaves nothing to compare: the row is dropped.
    assert encode_preference_row(row, tokenizer, len(prompt)) is None


def test_a_chat_rows_earlier_assistant_turns_are_context_not_targets(tiny: Tiny) -> None:
    _, tokenizer = tiny
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "2 plus 2?"}]
    chosen, rejected = {"role": "assistant", "content": "4"}, {"role": "assistant", "content": "5"}
    pair = encode_preference_row({"messages": messages, "chosen": chosen, "rejected": rejected}, tokenizer, 256)
    listed = encode_preference_row({"messages": messages, "chosen": [chosen], "rejected": [rejected]}, tokenizer, 256)
    assert pair is not None and pair == listed  # an answer as one message or as a list of them
    prompt = encode_prompt(tokenizer, messages=messages)
    full_ids, full_labels = encode_row({"messages": [*messages, chosen]}, tokenizer)
    assert pair.chosen.input_ids == full_ids and full_ids[:len(prompt)] == prompt
    # SFT would learn the earlier "hello there" turn too; here it is context, and the answer's tokens are the targets.
    assert _targets(full_labels) != _targets(pair.chosen.labels) == full_labels[len(prompt):]
    assert len(_targets(pair.chosen.labels)) > 0 and len(_targets(pair.rejected.labels)) > 0


def test_where_the_policy_is_the_reference_every_pair_costs_log_2_and_no_reward() -> None:
    ref_chosen, ref_rejected = torch.tensor([-12.0, -3.5]), torch.tensor([-9.0, -7.25])
    terms = dpo_terms(ref_chosen.clone(), ref_rejected.clone(), ref_chosen, ref_rejected, beta=0.1)
    torch.testing.assert_close(terms.losses, torch.full((2,), math.log(2.0)))
    assert terms.chosen_rewards.abs().max() == 0 and terms.reward_accuracy == 0 and terms.reward_margin == 0


def test_the_loss_and_its_gradient_are_the_papers() -> None:
    """L = -log sigmoid(beta m), m = (pi_c - ref_c) - (pi_r - ref_r); the paper's gradient (its eq. 7) is
    -beta sigmoid(-beta m) on log pi(chosen) and the opposite on log pi(rejected)."""
    generator = torch.Generator().manual_seed(0)
    policy = (torch.randn(2, 16, generator=generator, dtype=torch.float64) * 5).requires_grad_(True)
    ref = torch.randn(2, 16, generator=generator, dtype=torch.float64) * 5
    beta = 0.3
    terms = dpo_terms(policy[0], policy[1], ref[0], ref[1], beta=beta)
    margin = (policy[0] - ref[0]) - (policy[1] - ref[1])
    torch.testing.assert_close(terms.losses, -torch.log(1.0 / (1.0 + torch.exp(-beta * margin))))
    terms.losses.sum().backward()
    assert policy.grad is not None
    expected = -beta * torch.sigmoid(-beta * margin.detach())
    torch.testing.assert_close(policy.grad[0], expected)
    torch.testing.assert_close(policy.grad[1], -expected)
    torch.testing.assert_close(terms.chosen_rewards, beta * (policy[0] - ref[0]).detach())
    assert terms.reward_accuracy == (margin > 0).double().mean()


def test_label_smoothing_and_ipo() -> None:
    policy_c, policy_r, ref_c, ref_r = torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]),  \
        torch.tensor([-5.5])
    margin, beta = (-4.0 + 5.0) - (-6.0 + 5.5), 0.5  # 1.5
    smoothed = dpo_terms(policy_c, policy_r, ref_c, ref_r, beta=beta, label_smoothing=0.1)
    want = -0.9 * math.log(1 / (1 + math.exp(-beta * margin))) - 0.1 * math.log(1 / (1 + math.exp(beta * margin)))
    assert smoothed.losses.item() == pytest.approx(want)
    ipo = dpo_terms(policy_c, policy_r, ref_c, ref_r, beta=beta, loss_type="ipo")
    assert ipo.losses.item() == pytest.approx((margin - 1 / (2 * beta)) ** 2)
    with pytest.raises(ValueError, match="beta"):
        dpo_terms(policy_c, policy_r, ref_c, ref_r, beta=0.0)


def _plain_sums(model: PreTrainedModel, examples: list[Example]) -> torch.Tensor:
    """Each example's summed target-token cross-entropy under ``model``, one example at a time."""
    sums = []
    for example in examples:
        with torch.no_grad():
            logits = model(torch.tensor([example.input_ids])).logits[0, :-1].float()
        labels = torch.tensor(example.labels[1:])
        mask = labels != IGNORE_INDEX
        sums.append(-torch.log_softmax(logits[mask], -1).gather(1, labels[mask, None]).sum())
    return torch.stack(sums)


def test_the_reference_pass_is_the_bare_base_whatever_the_adapters(tiny: Tiny, fresh_tiny: Tiny) -> None:
    """DPO's reference log-probabilities come from the frozen base itself (`ModelPasses.reference_row_sums`, every
    adapter off, the output head's too): after a few steps the slot's own sums have moved, the reference has not."""
    model, tokenizer = tiny
    pair = encode_preference_row({"prompt": "2 plus 2 is", "chosen": " 4", "rejected": " 5"}, tokenizer, 64)
    assert pair is not None
    spec = make_spec("a", target_modules=["q_proj", "v_proj", "lm_head"], learning_rate=0.05)
    paths = resolve_target_modules(model, spec.target_modules)
    with PackEngine(model, tokenizer, capacity=1, max_rank=spec.lora_rank, target_modules=paths) as engine:
        slot = engine.admit(spec)
        for _ in range(3):
            engine.step()
        batch = engine.passes.pack([SlotRows(slot, [pair.chosen, pair.rejected])])
        with torch.no_grad():
            policy = engine.passes.row_loss_sums(batch, training=False)
        reference = engine.passes.reference_row_sums(batch)
    want = _plain_sums(fresh_tiny[0], [pair.chosen, pair.rejected])
    torch.testing.assert_close(reference, want, rtol=1e-5, atol=1e-5)
    assert (policy - want).abs().max() > 1e-3  # the adapter moved the slot's own


def test_each_rows_summed_loss_is_its_examples_negative_log_probability(tiny: Tiny, fresh_tiny: Tiny) -> None:
    """What DPO compares, from the packed stream of two slots' pairs (`ModelPasses.row_loss_sums`): each example's
    summed target-token cross-entropy, equal to the plain model's on that example alone (the slots' adapters are
    fresh: zero, the base's own answer)."""
    model, tokenizer = tiny
    rows = [{"prompt": "2 plus 2 is", "chosen": " 4", "rejected": " 5"},
            {"prompt": "the sky is", "chosen": " blue", "rejected": " green today"}]
    pairs = [encode_preference_row(row, tokenizer, 64) for row in rows]
    examples = [e for pair in pairs if pair is not None for e in (pair.chosen, pair.rejected)]
    specs = [make_spec("a"), make_spec("b")]
    paths = sorted({p for s in specs for p in resolve_target_modules(model, s.target_modules)})
    with PackEngine(model, tokenizer, capacity=2, max_rank=max(s.lora_rank for s in specs),
                    target_modules=paths) as engine:
        slots = [engine.admit(spec) for spec in specs]
        batch = engine.passes.pack([SlotRows(slots[0], examples[:2]), SlotRows(slots[1], examples[2:])])
        with torch.no_grad():
            sums = engine.passes.row_loss_sums(batch, training=False)
    torch.testing.assert_close(sums, _plain_sums(fresh_tiny[0], examples), rtol=1e-5, atol=1e-5)
    # The same from a batch of static shapes (a CUDA-graphed pack's: padding rows, and ignored targets in the last):
    # one sum per real row, the padding's dropped.
    with PackEngine(model, tokenizer, capacity=2, max_rank=4, target_modules=paths) as engine:
        slots = [engine.admit(spec) for spec in specs]
        static = engine.passes.pack([SlotRows(slots[0], examples[:2]), SlotRows(slots[1], examples[2:])],
                                    static_shapes=True)
        assert int(static.cu_seqlens.shape[0]) - 1 > static.n_rows == 4  # padding rows, which targets point into
        with torch.no_grad():
            torch.testing.assert_close(engine.passes.row_loss_sums(static, training=False), sums)
        torch.testing.assert_close(engine.passes.reference_row_sums(static), sums)
    # and the pairs' loss from them: at fresh adapters the policy is the reference, log 2 a pair
    terms = dpo_terms(-sums[0::2], -sums[1::2], -sums[0::2], -sums[1::2], beta=0.1)
    torch.testing.assert_close(terms.losses, torch.full((2,), math.log(2.0)))


def preference_rows(n: int) -> list[dict[str, Any]]:
    """Pairs a tiny model can learn to tell apart: counting up is preferred to counting down."""
    return [{"prompt": f"count from {i}", "chosen": " " + " ".join(str(i + k) for k in range(4)),
             "rejected": " " + " ".join(str(i - k) for k in range(4))} for i in range(n)]


def _dpo_spec(trial_id: str, beta: float, **overrides: Any) -> TrialSpec:
    fields: dict[str, Any] = {"train_rows": preference_rows(8), "val_rows": preference_rows(12)[8:],
                              "dpo": DpoObjective(beta=beta), "batch_size": 3, "max_steps": 6, "eval_interval": 3}
    return make_spec(trial_id, **(fields | overrides))


def _train(tiny: Tiny, specs: list[TrialSpec], steps: int) -> tuple[PackEngine, dict[str, list[float]],
                                                                     dict[str, ModuleTensors]]:
    """``steps`` steps of ``specs`` in one engine (left open: its reference cache is read after); each trial's
    losses and final adapter."""
    model, tokenizer = tiny
    paths = sorted({p for s in specs for p in resolve_target_modules(model, s.target_modules)})
    engine = PackEngine(model, tokenizer, capacity=len(specs), max_rank=max(s.lora_rank for s in specs),
                        target_modules=paths)
    slots = {spec.trial_id: engine.admit(spec) for spec in specs}
    losses: dict[str, list[float]] = {spec.trial_id: [] for spec in specs}
    for _ in range(steps):
        for trial_id, loss in engine.step().items():
            losses[trial_id].append(loss)
    return engine, losses, {trial_id: engine.adapter(slot) for trial_id, slot in slots.items()}


def test_a_pack_of_dpo_trials_and_an_sft_trial_trains_each_as_alone(tiny: Tiny) -> None:
    specs = [_dpo_spec("d1", 0.1), _dpo_spec("d2", 0.5, learning_rate=5e-2, seed=3, lora_dropout=0.1,
                                             dpo=DpoObjective(beta=0.5, label_smoothing=0.1)),
             _dpo_spec("ipo", 0.3, dpo=DpoObjective(beta=0.3, loss="ipo")), make_spec("sft", batch_size=2)]
    engine, packed, adapters = _train(tiny, specs, 5)
    engine.close()
    assert packed["d1"][0] == pytest.approx(math.log(2.0), rel=1e-5)  # a fresh adapter is the reference
    assert packed["d1"][-1] < packed["d1"][0] - 0.01 and packed["d2"][-1] < packed["d2"][0] - 0.01
    for spec in specs:
        alone, losses, adapter = _train(tiny, [spec], 5)
        alone.close()
        assert packed[spec.trial_id] == pytest.approx(losses[spec.trial_id], rel=1e-5), spec.trial_id
        for path, (a, b) in adapter[spec.trial_id].items():
            assert_rel_close(adapters[spec.trial_id][path][0], a)
            assert_rel_close(adapters[spec.trial_id][path][1], b)


def test_the_reference_pass_runs_once_per_pair_for_every_trial_and_epoch(tiny: Tiny, fresh_tiny: Tiny) -> None:
    """Three trials on the same eight pairs (batch 4: an epoch is two steps) for three epochs, validated on four
    pairs twice: the base runs for each of the twelve pairs once, not once per trial, step or validation, and what
    it cached is the plain base's log-probabilities."""
    specs = [_dpo_spec(f"t{i}", beta, batch_size=4, seed=i) for i, beta in enumerate((0.05, 0.1, 0.5))]
    engine, _, _ = _train(tiny, specs, 6)
    try:
        references = engine.training.references
        assert references.pairs_computed == 8
        evaluate_slots(engine, [0, 1, 2])
        evaluate_slots(engine, [0, 1, 2])
        assert references.pairs_computed == 8 + 4
        state = engine.state(0)
        cached = references.get(state.val_key, range(4)).reshape(-1)
        torch.testing.assert_close(cached, -_plain_sums(fresh_tiny[0], state.val), rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


def test_a_pack_reports_reward_metrics_and_the_best_adapters_reward_accuracy(tiny: Tiny, tmp_path: Path) -> None:
    points: list[tuple[str, int, str, float]] = []
    specs = [_dpo_spec("judged", 0.1, evaluation=Evaluation(metric=REWARD_ACCURACY), val_rows=preference_rows(8)),
             _dpo_spec("by-loss", 0.1)]
    config, callbacks, rest = pack_arguments(base_model_name="tiny-random-llama", export_dir=tmp_path,
                                             on_point=lambda *p: points.append(p))
    outcomes = train_pack(*tiny, specs, config, callbacks, **rest)
    assert [o.status for o in outcomes] == ["completed", "completed"]
    for trial_id in ("judged", "by-loss"):
        val_steps = [step for t, step, split, _ in points if t == trial_id and split == "val"]
        assert val_steps == [3, 6]
        for split in PREFERENCE_SPLITS:  # each validation's reward metrics beside its loss
            assert [step for t, step, s, _ in points if t == trial_id and s == split] == val_steps
    accuracy = {step: v for t, step, s, v in points if t == "judged" and s == "reward_acc"}
    assert all(0.0 <= v <= 1.0 for v in accuracy.values())
    metric = [(step, v) for t, step, s, v in points if t == "judged" and s == "metric"]
    best = outcomes[0].best_step
    assert best is not None and metric == [(6, accuracy[best])]  # once, at its end: its best adapter's
    assert not [p for p in points if p[0] == "by-loss" and p[2] == "metric"]
    margins = [v for t, _, s, v in points if t == "judged" and s == "margin"]
    assert margins[-1] > 0  # it learned to prefer counting up, on the rows it trained on
    assert (tmp_path / "judged" / "adapter_model.safetensors").exists()
