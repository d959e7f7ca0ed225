"""Direct Preference Optimisation's pieces (issue 36; Rafailov et al. 2023, "Direct Preference Optimization: Your
Language Model is Secretly a Reward Model"): a preference row as the two sequences the model scores, and the loss of
a batch of pairs from the four log-probabilities of each.

A pair's implicit rewards are ``beta * (log pi(y|x) - log pi_ref(y|x))`` for its chosen and its rejected answer; the
sigmoid loss is ``-log sigmoid(chosen reward - rejected reward)``, label-smoothed as in "conservative DPO"
(``-(1 - eps) log sigmoid(m) - eps log sigmoid(-m)``, ``m`` the rewards' difference), and IPO (Azar et al. 2023) is
``(margin - 1 / (2 beta))^2`` on the unscaled log-ratio margin (TRL feeds IPO per-token means, the sigmoid loss sums:
the caller chooses). The frozen base is the reference: its log-probabilities come from the base without adapters, so
no second model is held.

In a pack, a DPO trial's micro-batch of pairs is its rows' chosen and rejected sequences side by side in the pack's
one packed stream (each pair's two adjacent), scored per sequence (``ModelPasses.row_loss_sums``); its loss is the
mean of its pairs' losses, beside the SFT trials' token means (``slot_losses``: a pack may mix them). The reference
log-probabilities come from a pass of the base with every adapter off, once per pair and dataset, cached on the
device and read by every trial of the engine that reads those rows, at every epoch (``ReferenceCache``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from worker.engine.batch import SlotRows, cut_forwards
from worker.engine.data import IGNORE_INDEX, Example, encode_prompt, encode_row
from worker.engine.spec import DpoObjective

if TYPE_CHECKING:
    from worker.engine.passes import ModelPasses

DpoLossType = Literal["sigmoid", "ipo"]
DataKey = tuple[str, int]  # a dataset's tokenisation key (PackEngine._encode): its rows' hash and max_seq_len
# The points a DPO trial's validation reports besides its loss ("val"), named as the service stores them
# (common/metrics.py PREFERENCE_SPLITS, tested equal): the share of pairs whose chosen answer the trial rewards more,
# the mean reward margin, and the mean rewards of the chosen and of the rejected answers.
PREFERENCE_SPLITS = ("reward_acc", "margin", "chosen", "rejected")
# The metric (``Evaluation.metric``) that judges a DPO trial by its best adapter's validation reward accuracy, as its
# "metric" point (common/metrics.py), without generating anything.
REWARD_ACCURACY = "reward_accuracy"


@dataclass(frozen=True)
class PreferencePair:
    """One preference row as the model scores it: the prompt followed by each answer, the answer's tokens the
    targets (the prompt's are not, earlier assistant turns of a chat prompt included)."""

    chosen: Example
    rejected: Example


def encode_preference_row(row: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase,
                          max_seq_len: int) -> PreferencePair | None:
    """The row's two sequences (its chosen, then its rejected answer), each truncated to ``max_seq_len``; None when
    truncation leaves either answer without a target token (the pair cannot be compared). Rows as common/datasets.py
    validates them: ``prompt`` text with ``chosen``/``rejected`` text, or ``messages`` (the prompt) with
    ``chosen``/``rejected`` assistant messages (one, or a list)."""
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


def encode_preference_rows(rows: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase,
                           max_seq_len: int) -> list[Example]:
    """The pairs of ``rows`` as the engine keeps them: each pair's chosen then its rejected sequence, a pair that
    truncation leaves without a target token on either side left out."""
    examples: list[Example] = []
    for row in rows:
        pair = encode_preference_row(row, tokenizer, max_seq_len)
        if pair is not None:
            examples += [pair.chosen, pair.rejected]
    return examples


def pair_log_probs(row_sums: torch.Tensor) -> torch.Tensor:
    """``(pairs, 2)`` summed log-probabilities (chosen, rejected) from the ``(2 * pairs,)`` summed cross-entropies of
    sequences in pair order."""
    return -row_sums.view(-1, 2)


def pair_terms(row_sums: torch.Tensor, reference: torch.Tensor, examples: Sequence[Example],
               objective: DpoObjective) -> DpoTerms:
    """``dpo_terms`` of the pairs whose sequences (``examples``, pair order) have the summed cross-entropies
    ``row_sums`` under the trial, against their ``(pairs, 2)`` summed reference log-probabilities: compared summed
    over each answer's tokens for the sigmoid loss (the DPO paper's), per token for IPO (as TRL feeds it)."""
    policy = pair_log_probs(row_sums)
    if objective.loss == "ipo":
        tokens = torch.tensor([e.n_targets for e in examples], dtype=policy.dtype, device=policy.device).view(-1, 2)
        policy, reference = policy / tokens, reference / tokens
    loss_type: DpoLossType = "ipo" if objective.loss == "ipo" else "sigmoid"
    return dpo_terms(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], beta=objective.beta,
                     loss_type=loss_type, label_smoothing=objective.label_smoothing)


class ReferenceCache:
    """The reference model's (the bare base's) log-probabilities of each pair's chosen and rejected answer, by
    dataset and pair, on the device: computed once per pair (``fill_references``), then read by every trial of the
    engine that reads the same rows, at every epoch. ``pairs_computed`` counts the pairs the base was run for."""

    def __init__(self) -> None:
        self._values: dict[DataKey, torch.Tensor] = {}  # (pairs, 2) float32
        self._known: dict[DataKey, set[int]] = {}
        self.pairs_computed = 0

    def missing(self, key: DataKey, items: Sequence[int]) -> list[int]:
        known = self._known.get(key, set())
        return sorted({i for i in items if i not in known})

    def put(self, key: DataKey, pairs: int, items: Sequence[int], values: torch.Tensor) -> None:
        if key not in self._values:
            self._values[key] = torch.zeros(pairs, 2, dtype=torch.float32, device=values.device)
            self._known[key] = set()
        self._values[key][torch.tensor(list(items), device=values.device)] = values.float()
        self._known[key].update(items)
        self.pairs_computed += len(items)

    def get(self, key: DataKey, items: Sequence[int]) -> torch.Tensor:
        values = self._values[key]
        return values[torch.tensor(list(items), device=values.device)]

    def drop(self, key: DataKey) -> None:
        self._values.pop(key, None)
        self._known.pop(key, None)


@dataclass(frozen=True)
class PairRows:
    """Pairs a pass needs the reference of: the dataset's sequences (pair order) under its key, and which pairs."""

    key: DataKey
    examples: Sequence[Example]
    items: Sequence[int]


@torch.no_grad()
def fill_references(passes: ModelPasses, cache: ReferenceCache, needs: Sequence[PairRows], max_tokens: int) -> None:
    """Run the bare base over the pairs of ``needs`` the cache lacks (each once, however many trials ask), in
    forwards of at most ``max_tokens`` tokens, and cache their log-probabilities."""
    missing: dict[DataKey, set[int]] = {}
    examples: dict[DataKey, Sequence[Example]] = {}
    for need in needs:
        missing.setdefault(need.key, set()).update(cache.missing(need.key, need.items))
        examples[need.key] = need.examples
    wanted = {key: sorted(items) for key, items in missing.items() if items}
    if not wanted:
        return
    sequences = [examples[key][2 * i + j] for key, items in wanted.items() for i in items for j in (0, 1)]
    sums = [passes.reference_row_sums(passes.pack(parts)) for parts in cut_forwards([(0, sequences)], max_tokens)]
    log_probs = pair_log_probs(torch.cat(sums))  # summed: pair_terms divides where the loss wants means
    start = 0
    for key, items in wanted.items():
        cache.put(key, len(examples[key]) // 2, items, log_probs[start : start + len(items)])
        start += len(items)


def slot_losses(row_sums: torch.Tensor, parts: Sequence[SlotRows], objectives: Mapping[int, DpoObjective | None],
                references: Mapping[int, torch.Tensor], target_counts: torch.Tensor) -> torch.Tensor:
    """``(Z,)`` each slot's loss from its sequences' summed cross-entropies ``row_sums`` (the batch's rows in
    ``parts`` order): an SFT slot's mean over its target tokens, a DPO slot's mean over its pairs of the DPO loss
    against its pairs' ``references`` (``(pairs, 2)``)."""
    slots, values, offset = [], [], 0
    for part in parts:
        sums = row_sums[offset : offset + len(part.examples)]
        offset += len(part.examples)
        objective = objectives[part.slot]
        if objective is None:
            values.append(sums.sum() / target_counts[part.slot])
        else:
            values.append(pair_terms(sums, references[part.slot], part.examples, objective).losses.mean())
        slots.append(part.slot)
    index = torch.tensor(slots, device=row_sums.device)
    return torch.zeros_like(target_counts).index_add(0, index, torch.stack(values))


@dataclass(frozen=True)
class PreferenceMetrics:
    """A DPO trial's validation: its mean pair loss and its reward metrics over the validation pairs."""

    loss: float
    reward_accuracy: float
    reward_margin: float
    chosen_reward: float
    rejected_reward: float

    def as_points(self) -> dict[str, float]:
        """The values of ``PREFERENCE_SPLITS``, in that order."""
        values = (self.reward_accuracy, self.reward_margin, self.chosen_reward, self.rejected_reward)
        return dict(zip(PREFERENCE_SPLITS, values, strict=True))


def preference_metrics(terms: DpoTerms) -> torch.Tensor:
    """``(5,)`` the mean loss, reward accuracy, reward margin, chosen and rejected reward of ``terms`` (stacked, for
    one device sync over many trials: ``PreferenceMetrics(*values)``)."""
    return torch.stack([terms.losses.mean(), terms.reward_accuracy, terms.reward_margin,
                        terms.chosen_rewards.mean(), terms.rejected_rewards.mean()]).float()
