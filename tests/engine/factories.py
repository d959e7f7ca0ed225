"""Test data and trial factories shared by the engine tests."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from common.metrics import score_answers
from common.tiny_tokenizer import TINY_TOKENIZER
from worker.engine import Evaluation, ModelSource, PackCallbacks, PackConfig, PackEngine, TrialSpec
from worker.engine.data import BatchSampler, collate, encode_rows
from worker.engine.spec import trial_seed
from worker.engine.store import ModuleTensors

TINY = ModelSource(name="tiny-random-llama", kind="tiny-random-llama", tokenizer=TINY_TOKENIZER)
CPU = torch.device("cpu")


def chat_rows(n: int) -> list[dict[str, Any]]:
    """Small, repetitive chat data a tiny model can learn in a few dozen steps."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"count from {i}"},
                {"role": "assistant", "content": " ".join(str(i + k) for k in range(4))},
            ]
        }
        for i in range(n)
    ]


def completion_rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"spell {w}:", "completion": " " + "-".join(w)} for w in ["cat", "dog", "owl", "bee"][:n]]


def make_spec(trial_id: str, **overrides: Any) -> TrialSpec:
    fields: dict[str, Any] = {
        "trial_id": trial_id,
        "learning_rate": 2e-2,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lora_dropout": 0.0,
        "batch_size": 4,
        "target_modules": ["q_proj", "v_proj"],
        "seed": 1,
        "max_steps": 12,
        "max_seq_len": 64,
        "eval_interval": 4,
        "train_rows": chat_rows(8),
        "val_rows": chat_rows(4),
    }
    fields.update(overrides)
    return TrialSpec(**fields)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over target tokens from full logits: the definition the engine's
    chunked loss must equal. ``logits (batch, seq, vocab)``, ``labels (batch, seq)``; position t predicts t + 1."""
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """``‖got − want‖ / ‖want‖ < rel``: "equal within 1e-5 relative" for a whole tensor. Element-wise it
    would be ill-posed: AdamW's m / sqrt(v) turns a last-bit difference in a near-zero gradient (the BLAS
    blocks differently for a pack's token count than for one trial's) into a 1e-4 relative one on a
    near-zero weight."""
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"


def peft_adamw_reference(model: Any, tokenizer: Any, spec: TrialSpec, init: ModuleTensors, steps: int
                         ) -> tuple[Any, list[float]]:
    """What the engine's training of one trial must equal: ``model`` wrapped by PEFT with ``spec``'s LoRA, starting
    from the engine's initial adapter ``init``, trained ``steps`` steps by torch AdamW with ``spec``'s
    hyperparameters on ``spec``'s batches (the same sampler, padded batches, the mean target-token loss, no
    dropout). Returns the PEFT model and its losses."""
    import peft

    assert spec.lora_alpha.is_integer(), "PEFT's LoraConfig takes an integer alpha"
    config = peft.LoraConfig(r=spec.lora_rank, lora_alpha=int(spec.lora_alpha), lora_dropout=0.0,
                             target_modules=list(spec.target_modules))
    peft_model: Any = peft.get_peft_model(model, config)
    for path, (a, b) in init.items():
        layer = peft_model.base_model.model.get_submodule(path)
        layer.lora_A["default"].weight.data.copy_(a)
        layer.lora_B["default"].weight.data.copy_(b)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.learning_rate, betas=(spec.beta1, spec.beta2), eps=spec.eps,
                                  weight_decay=spec.weight_decay)
    examples = encode_rows(spec.train_rows, tokenizer, spec.max_seq_len)
    sampler = BatchSampler(len(examples), spec.batch_size, trial_seed(spec.seed, "data"))
    losses = []
    for _ in range(steps):
        batch = collate([examples[i] for i in sampler.next_indices()], int(tokenizer.pad_token_id))
        logits = peft_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss = token_loss_sum(logits, batch.labels) / int((batch.labels[:, 1:] != -100).sum())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return peft_model, losses


class Persisted:
    """An ``on_checkpoint`` that records, per trial, the steps of the checkpoints the pack's writer persisted (and
    copies each to ``into/<trial>/<step>/`` when given); ``wait`` blocks until one of a trial's is persisted.

    Which periodic snapshots the writer persists depends on its pace (a newer one supersedes one not started), so a
    test that needs a given step waits for it from ``on_point`` at the trial's next step: that step's snapshot was
    taken, and no newer one can supersede it before the wait ends.
    """

    def __init__(self, into: Path | None = None) -> None:
        self.into = into
        self.steps: dict[str, list[int]] = {}
        self._changed = threading.Condition()

    def __call__(self, trial_id: str, step: int, path: Path) -> None:
        if self.into is not None:
            shutil.copytree(path, self.into / trial_id / str(step))
        with self._changed:
            self.steps.setdefault(trial_id, []).append(step)
            self._changed.notify_all()

    def wait(self, trial_id: str, step: int, timeout_s: float = 60.0) -> None:
        """Until the checkpoint of ``trial_id`` at ``step`` is persisted."""
        with self._changed:
            assert self._changed.wait_for(lambda: step in self.steps.get(trial_id, []), timeout_s), (
                f"no checkpoint of {trial_id} at step {step} after {timeout_s} s: {self.steps}")


def record_engines(monkeypatch: pytest.MonkeyPatch) -> list[PackEngine]:
    """Every ``PackEngine`` made from now on in the test, the newest last: a fake of the engine's passes
    (``ModelPasses``, which knows no trial) looks the trials up in the engine that runs it."""
    engines: list[PackEngine] = []
    real_init = PackEngine.__init__

    def recording_init(engine: PackEngine, *args: Any, **kwargs: Any) -> None:
        real_init(engine, *args, **kwargs)
        engines.append(engine)

    monkeypatch.setattr(PackEngine, "__init__", recording_init)
    return engines


def score(evaluation: Evaluation, answers: list[str], references: list[str]) -> float:
    """A trial's generative metric as the worker scores it (common/metrics.py; worker/pack_runner.py's ``score_metric``
    also turns a refused pattern into ``NoScore``), for the packs the tests train."""
    return score_answers(evaluation.metric, answers, references, evaluation.pattern)


def pack_arguments(**kwargs: Any) -> tuple[PackConfig, PackCallbacks, dict[str, Any]]:
    """``train_pack``'s keywords as a test helper takes them, flat, sorted into its ``PackConfig``, its
    ``PackCallbacks`` and the rest (``resume``, ``timings``, ``lockstep``, ``keeper``)."""
    config = {f.name for f in dataclasses.fields(PackConfig)}
    callbacks = {f.name for f in dataclasses.fields(PackCallbacks)}
    return (PackConfig(**{k: v for k, v in kwargs.items() if k in config}),
            PackCallbacks(**{k: v for k, v in kwargs.items() if k in callbacks}),
            {k: v for k, v in kwargs.items() if k not in config | callbacks})
