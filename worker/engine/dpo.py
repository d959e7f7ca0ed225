"""Direct Preference Optimisation's pieces (issue 36; Rafailov et al. 2023, "Direct Preference Optimization: Your
Language Model is Secretly a Reward Model"): a preference row as the two sequences the model scores, and the loss of
a batch of pairs from the four log-probabilities of each.

A pair's implicit rewards are ``beta * (log pi(y|x) - log pi_ref(y|x))`` for its chosen and its rejected answer; the
sigmoid loss is ``-log sigmoid(chosen reward - rejected reward)``, label-smoothed as in "conservative DPO"
(``-(1 - eps) log sigmoid(m) - eps log sigmoid(-m)``, ``m`` the rewards' difference), and IPO (Azar et al. 2023) is
``(margin - 1 / (2 beta))^2`` on the unscaled log-ratio margin (TRL feeds IPO per-token means, the sigmoid loss sums:
the caller chooses). The frozen base is the reference: its log-probabilities come from the base without adapters, so
no second model is held.

Not yet wired into the training step (the pack's packed forward, its reference pass and its metrics): this module is
what that step will call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from worker.engine.data import IGNORE_INDEX, Example, encode_prompt, encode_row

DpoLossType = Literal["sigmoid", "ipo"]


@dataclass(frozen=True)
class PreferencePair:
    """One preference row as the model scores it: the prompt followed by each answer, the answer's tokens the
    targets (the prompt's are not, earlier assistant turns of a chat prompt included)."""

    chosen: Example
    rejected: Example


def encode_preference_row(row: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase,
                          max_seq_len: int) -> PreferencePair | None:
    """The row's two sequences, each truncated to ``max_seq_len``; None when truncation leaves either answer without
    a target token (the pair cannot be compared). Rows as common/datasets.py validates them: ``prompt`` text with
    ``chosen``/``rejected`` text, or ``messages`` (the prompt) with ``chosen``/``rejected`` assistant messages (one,
    or a list)."""
    pair = []
    for name in ("chosen", "rejected"):
        if "messages" in row:
            answer = row[name] if isinstance(row[name], list) else [row[name]]
            input_ids, labels = encode_row({"messages": [*row["messages"], *answer]}, tokenizer)
            prompt = len(encode_prompt(tokenizer, messages=row["messages"]))
            labels = [IGNORE_INDEX] * prompt + labels[prompt:]  # the prompt's assistant turns are context only
        else:
            input_ids, labels = encode_row({"prompt": row["prompt"], "completion": row[name]}, tokenizer)
        example = Example(input_ids[:max_seq_len], labels[:max_seq_len])
        if example.n_targets == 0:
            return None
        pair.append(example)
    return PreferencePair(pair[0], pair[1])


@dataclass(frozen=True)
class DpoTerms:
    """Per pair: the loss and the two implicit rewards (``beta`` times the policy's log-ratio to the reference)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def reward_accuracy(self) -> torch.Tensor:
        """The share of pairs whose chosen answer the policy rewards more than the rejected one."""
        return (self.chosen_rewards > self.rejected_rewards).float().mean()

    @property
    def reward_margin(self) -> torch.Tensor:
        return (self.chosen_rewards - self.rejected_rewards).mean()


def dpo_terms(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
              ref_rejected: torch.Tensor, *, beta: float, loss_type: DpoLossType = "sigmoid",
              label_smoothing: float = 0.0) -> DpoTerms:
    """The DPO loss of each pair from the summed log-probabilities of its answers' tokens under the policy and the
    reference (each ``(pairs,)``). The rewards carry no gradient (they are what is reported)."""
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    margin = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = (-F.logsigmoid(beta * margin) * (1.0 - label_smoothing)
                  - F.logsigmoid(-beta * margin) * label_smoothing)
    elif loss_type == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    return DpoTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
