"""Test data and trial factories shared by the engine tests."""

from __future__ import annotations

from typing import Any

import torch

from worker.engine import ModelSource, TrialSpec

TINY = ModelSource(name="tiny-random-llama", kind="tiny-random-llama")
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
