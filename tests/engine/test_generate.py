"""Greedy generation for a generative metric (issue 17): every slot's rows in shared packed forwards, each under
its own adapter, equal to what PEFT's `generate` decodes with that adapter alone; and the prompts it starts from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import CPU, TINY, chat_rows, completion_rows, make_spec, score
from worker.engine import PackEngine, load_base_model
from worker.engine.data import eval_prompt
from worker.engine.generation import generate
from worker.engine.slot_export import export

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def test_eval_prompts_end_where_the_answer_starts(tiny: Tiny) -> None:
    _, tokenizer = tiny
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}
    ids, reference = eval_prompt(chat, tokenizer)
    assert reference == "4"
    assert tokenizer.decode(ids).endswith("<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    ids, reference = eval_prompt({"prompt": "spell cat:", "completion": " c-a-t"}, tokenizer)
    assert (tokenizer.decode(ids), reference) == ("spell cat:", " c-a-t")


def test_generation_of_two_slots_at_once_equals_peft_generate_with_each_adapter(
    tiny: Tiny, model_cache: Path, tmp_path: Path
) -> None:
    model, tokenizer = tiny
    specs = [make_spec("a", target_modules=["all-linear"], val_rows=[]),
             make_spec("b", target_modules=["q_proj", "v_proj"], train_rows=completion_rows(4), seed=5, val_rows=[])]
    rows = {"a": chat_rows(3), "b": completion_rows(3)}
    stop = frozenset({int(tokenizer.eos_token_id)})
    with PackEngine(model, tokenizer, capacity=2, max_rank=4) as engine:
        slots = {s.trial_id: engine.admit(s) for s in specs}
        for _ in range(15):
            engine.step()
        prompts = {slots[t]: [eval_prompt(r, tokenizer)[0] for r in rows[t]] for t in slots}
        answers = generate(engine, prompts, max_new_tokens=12, stop_ids=stop)
        for trial_id, slot in slots.items():
            export(engine, slot, tmp_path / trial_id, base_model_name="tiny")
    assert any(answers[slots["a"]]) and any(answers[slots["b"]])
    for trial_id, slot in slots.items():
        fresh, _ = load_base_model(TINY, cache_dir=model_cache, device=CPU)
        peft_model = PeftModel.from_pretrained(fresh, tmp_path / trial_id).eval()
        for prompt, answer in zip(prompts[slot], answers[slot], strict=True):
            with torch.no_grad():
                out = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=list(stop), pad_token_id=tokenizer.pad_token_id)
            expected = out[0, len(prompt):].tolist()
            if expected and expected[-1] in stop:
                expected = expected[:-1]
            assert answer == expected, (trial_id, tokenizer.decode(prompt))


def test_a_trial_with_a_generative_metric_reports_its_best_adapters_score_once_at_its_end(
    tiny: Tiny, tmp_path: Path
) -> None:
    from common.metrics import score_answers
    from worker.engine import Evaluation, PackCallbacks, PackConfig, train_pack
    from worker.engine.export import read_peft_adapter

    model, tokenizer = tiny
    val = chat_rows(4)
    scored = make_spec("m", max_steps=24, eval_interval=8, val_rows=val, target_modules=["all-linear"],
                       evaluation=Evaluation(metric="contains", max_new_tokens=10))
    plain = make_spec("p", max_steps=16, val_rows=val, seed=3)
    points: list[tuple[str, int, str, float]] = []
    outcomes = train_pack(
        model, tokenizer, [scored, plain],
        PackConfig(base_model_name="tiny", export_dir=tmp_path),
        PackCallbacks(on_point=lambda *p: points.append(p), score=score),
    )
    metric = [p for p in points if p[2] == "metric"]
    assert [(p[0], p[1]) for p in metric] == [("m", 24)]  # the scored trial only, once, at its last step
    # The same score from its exported (best) adapter, generated and scored again here.
    config, tensors = read_peft_adapter(next(o for o in outcomes if o.trial_id == "m").adapter_dir)
    with PackEngine(model, tokenizer, capacity=1, max_rank=4) as engine:
        slot = engine.admit(make_spec("again", target_modules=["all-linear"]))
        engine.store.load_slot(slot, tensors, rank=config.rank, scale=config.scale)
        pairs = [eval_prompt(row, tokenizer) for row in val]
        answers = generate(engine, {slot: [ids for ids, _ in pairs]}, max_new_tokens=10,
                           stop_ids=frozenset({int(tokenizer.eos_token_id)}))[slot]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]
    assert any(texts)  # it answered something (a score of 0 would otherwise be easy to match)
    assert metric[0][3] == score_answers("contains", texts, [ref for _, ref in pairs])


def test_a_trial_is_scored_at_its_early_exit_rungs_too_and_trains_on_exactly_as_unscored(
    tiny: Tiny, tmp_path: Path
) -> None:
    from worker.engine import Evaluation, PackCallbacks, PackConfig, train_pack
    from worker.engine.export import read_peft_adapter

    model, tokenizer = tiny
    val = chat_rows(4)
    # Validation every 8 steps; the scheduler's rungs at 5 and 11 (extra validations), and at 16 on an interval.
    common = dict(max_steps=24, eval_interval=8, val_rows=val, target_modules=["all-linear"], learning_rate=0.1,
                  extra_eval_steps=(5, 11, 16))
    runs = {}
    for name, evaluation in (("scored", Evaluation(metric="contains", max_new_tokens=10)), ("plain", None)):
        points: list[tuple[str, int, str, float]] = []
        outcomes = train_pack(
            model, tokenizer, [make_spec("t", evaluation=evaluation, **common)],
            PackConfig(base_model_name="tiny", export_dir=tmp_path / name),
            PackCallbacks(on_point=lambda *p, into=points: into.append(p), score=score),
        )
        runs[name] = (points, outcomes[0])
    scored_points, scored = runs["scored"]
    plain_points, plain = runs["plain"]
    assert [p[1] for p in scored_points if p[2] == "metric"] == [5, 11, 16, 24]  # each rung, then the end
    assert all(0.0 <= p[3] <= 1.0 for p in scored_points if p[2] == "metric")
    # Generating with the best adapter in between left the training untouched: the same curves and adapter.
    assert [p for p in scored_points if p[2] != "metric"] == plain_points
    val_losses = [p[3] for p in plain_points if p[2] == "val"]
    # (At some rung the best adapter was an earlier one, so the weights put back differed from those generated with.)
    assert any(v > min(val_losses[:i]) for i, v in enumerate(val_losses) if i), val_losses
    (_, a), (_, b) = read_peft_adapter(scored.adapter_dir), read_peft_adapter(plain.adapter_dir)
    assert all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


def test_generation_split_into_forwards_of_a_token_budget_gives_the_same_answers(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.engine import generation

    model, tokenizer = tiny
    spec = make_spec("s", target_modules=["all-linear"], val_rows=[])
    prompts = [eval_prompt(row, tokenizer)[0] for row in chat_rows(5)]
    stop = frozenset({int(tokenizer.eos_token_id)})
    results = []
    for budget in (generation.EVAL_MAX_TOKENS, 40):  # 40 tokens: about one row per forward
        monkeypatch.setattr(generation, "EVAL_MAX_TOKENS", budget)
        with PackEngine(model, tokenizer, capacity=1, max_rank=4) as engine:
            slot = engine.admit(spec)
            for _ in range(10):
                engine.step()
            results.append(generate(engine, {slot: prompts}, max_new_tokens=8, stop_ids=stop)[slot])
    assert results[0] == results[1] and any(results[0])


def test_a_trial_reports_the_steps_and_real_tokens_it_trained_in_its_pack(tiny: Tiny, tmp_path: Path) -> None:
    """Issue 18's usage accounting: a batch of every row each step, so the tokens are the rows' lengths x steps."""
    from worker.engine import PackCallbacks, PackConfig, train_pack
    from worker.engine.data import encode_rows

    model, tokenizer = tiny
    rows = chat_rows(4)
    spec = make_spec("u", train_rows=rows, batch_size=4, max_steps=3, val_rows=[])
    (outcome,) = train_pack(
        model, tokenizer, [spec],
        PackConfig(base_model_name="tiny", export_dir=tmp_path),
        PackCallbacks(on_point=lambda *_: None),
    )
    lengths = sum(len(e.input_ids) for e in encode_rows(rows, tokenizer, spec.max_seq_len))
    assert (outcome.pack_steps, outcome.pack_tokens) == (3, 3 * lengths)


def test_a_trial_its_scorer_gives_no_score_goes_without_a_metric_and_completes(
    tiny: Tiny, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's scorer raises ``NoScore`` for a regex pattern the policy refuses when compiled
    (worker/pack_runner.py's ``score_metric``): the trial has no metric point, says why in the log, and completes."""
    from worker.engine import Evaluation, NoScore, PackCallbacks, PackConfig, train_pack

    def refuses(evaluation: Evaluation, answers: list[str], references: list[str]) -> float:
        raise NoScore("its pattern is refused (a test's)")

    model, tokenizer = tiny
    spec = make_spec("n", max_steps=4, val_rows=chat_rows(2),
                     evaluation=Evaluation(metric="regex", max_new_tokens=4, pattern="x"))
    points: list[tuple[str, int, str, float]] = []
    (outcome,) = train_pack(model, tokenizer, [spec], PackConfig(base_model_name="tiny", export_dir=tmp_path),
                            PackCallbacks(on_point=lambda *p: points.append(p), score=refuses))
    assert outcome.status == "completed" and outcome.adapter_dir is not None
    assert [p for p in points if p[2] == "metric"] == [] and [p for p in points if p[2] == "val"]
    assert "trial n goes without a metric: its pattern is refused (a test's)" in caplog.text
