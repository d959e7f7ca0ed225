"""DPO's pieces (worker/engine/dpo.py, issue 36): a preference row as the two sequences the model scores, and the
loss of a batch of pairs, checked against what the DPO paper derives (its value where the policy is the reference,
its gradient) and the label-smoothed and IPO forms. Training with it is not wired yet."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import make_spec
from worker.engine import PackEngine
from worker.engine.batch import SlotRows
from worker.engine.data import IGNORE_INDEX, Example, encode_prompt, encode_row
from worker.engine.dpo import dpo_terms, encode_preference_row
from worker.engine.lora import resolve_target_modules

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
    # and the pairs' loss from them: at fresh adapters the policy is the reference, log 2 a pair
    terms = dpo_terms(-sums[0::2], -sums[1::2], -sums[0::2], -sums[1::2], beta=0.1)
    torch.testing.assert_close(terms.losses, torch.full((2,), math.log(2.0)))
