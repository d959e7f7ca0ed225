"""Sampling under many adapters at once (worker/engine/sampling.py): PEFT's own greedy answers reproduced, a batch
over several adapters and the base equal to each request alone, seeded sampling, top-p and stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.engine.factories import chat_rows, make_spec
from worker.engine import PackCallbacks, PackConfig, read_peft_adapter, train_pack
from worker.engine.lora import StackedLoraLinear
from worker.engine.sampling import FINISH_LENGTH, FINISH_STOP, Adapter, SampleJob, sample

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


@pytest.fixture(scope="module")
def adapter_dirs(_tiny_session: Tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of different ranks, targets and training, trained in one pack."""
    out = tmp_path_factory.mktemp("adapters")
    specs = [make_spec("a", max_steps=10, lora_rank=4, learning_rate=3e-2),
             make_spec("b", max_steps=10, lora_rank=8, learning_rate=1e-2, target_modules=["all-linear"], seed=2)]
    outcomes = train_pack(*_tiny_session, specs, PackConfig(base_model_name="tiny-random-llama", export_dir=out),
                          PackCallbacks(on_point=lambda *p: None))
    assert all(o.status == "completed" for o in outcomes)
    return {o.trial_id: o.adapter_dir for o in outcomes if o.adapter_dir is not None}


def _adapter(key: str, adapter_dir: Path) -> Adapter:
    config, tensors = read_peft_adapter(adapter_dir)
    return Adapter(key, config, tensors)


def _prompt(tokenizer: PreTrainedTokenizerBase, i: int) -> list[int]:
    messages = chat_rows(i + 1)[i]["messages"][:1]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _run(tiny: Tiny, jobs: list[SampleJob], **kwargs: object) -> list[SampleJob]:
    model, tokenizer = tiny
    sample(model, jobs, stop_ids=frozenset({tokenizer.eos_token_id}), pad_token_id=tokenizer.pad_token_id,
           **kwargs)  # type: ignore[arg-type]
    assert not any(isinstance(m, StackedLoraLinear) for m in model.modules()), "the adapters were not taken off"
    return jobs


def test_greedy_answer_equals_peft_generate(tiny: Tiny, fresh_tiny: Tiny, adapter_dirs: dict[str, Path]) -> None:
    model, tokenizer = fresh_tiny
    peft = PeftModel.from_pretrained(model, str(adapter_dirs["b"]))
    for i in range(3):
        prompt = _prompt(tokenizer, i)
        ids = torch.tensor([prompt])
        want = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        (job,) = _run(tiny, [SampleJob(prompt, _adapter("b", adapter_dirs["b"]), max_tokens=12)])
        if want and want[-1] == tokenizer.eos_token_id:
            assert job.finish_reason == FINISH_STOP and job.tokens == want[:-1]
        else:
            assert job.finish_reason == FINISH_LENGTH and job.tokens == want
        assert job.tokens, "an empty answer proves nothing"


def test_a_batch_over_adapters_and_the_base_equals_each_request_alone(tiny: Tiny,
                                                                       adapter_dirs: dict[str, Path]) -> None:
    _, tokenizer = tiny
    a, b = _adapter("a", adapter_dirs["a"]), _adapter("b", adapter_dirs["b"])
    specs = [(0, b, 0.0), (1, a, 0.0), (2, None, 0.0), (3, b, 0.9), (4, a, 0.7), (5, b, 0.0)]

    def jobs() -> list[SampleJob]:
        return [SampleJob(_prompt(tokenizer, i), adapter, max_tokens=4 + 2 * i, temperature=t, seed=i)
                for i, adapter, t in specs]

    together = _run(tiny, jobs())
    alone = [_run(tiny, [job])[0] for job in jobs()]
    assert [(j.tokens, j.finish_reason) for j in together] == [(j.tokens, j.finish_reason) for j in alone]
    # the adapters matter: the same prompt answered differently under a, b and the base
    prompt = _prompt(tokenizer, 0)
    answers = _run(tiny, [SampleJob(prompt, x, max_tokens=12) for x in (a, b, None)])
    assert len({tuple(j.tokens) for j in answers}) == 3


def test_sampling_follows_the_seed_and_top_p(tiny: Tiny) -> None:
    _, tokenizer = tiny
    prompt = _prompt(tokenizer, 1)

    def run(**kw: float) -> list[int]:
        return _run(tiny, [SampleJob(prompt, None, max_tokens=16, **kw)])[0].tokens  # type: ignore[arg-type]

    assert run(temperature=1.5, seed=3) == run(temperature=1.5, seed=3)
    assert run(temperature=1.5, seed=3) != run(temperature=1.5, seed=4)
    assert run(temperature=1.5, seed=3, top_p=1e-6) == run(temperature=0.0)  # a nucleus of one token is greedy


def test_on_token_stops_a_job_and_leaves_the_others(tiny: Tiny) -> None:
    _, tokenizer = tiny
    jobs = [SampleJob(_prompt(tokenizer, i), None, max_tokens=8, temperature=1.5, seed=i) for i in range(3)]
    seen: dict[int, int] = {}

    def on_token(index: int, token: int) -> bool:
        seen[index] = seen.get(index, 0) + 1
        return not (index == 1 and seen[index] == 3)

    _run(tiny, jobs, on_token=on_token)
    assert len(jobs[1].tokens) == 3 and jobs[1].finish_reason == FINISH_STOP
    assert {len(jobs[0].tokens), len(jobs[2].tokens)} <= set(range(1, 9))
    # an empty prompt or max_tokens 0 answers nothing
    empty = _run(tiny, [SampleJob([], None, max_tokens=4), SampleJob(_prompt(tokenizer, 0), None, max_tokens=0)])
    assert [(j.tokens, j.finish_reason) for j in empty] == [([], FINISH_LENGTH), ([], FINISH_LENGTH)]
