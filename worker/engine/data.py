"""Turn raw JSONL rows into labelled token sequences, and draw padded batches from them.

Labels follow the Hugging Face convention: ``labels[t]`` is the token at position ``t`` when it is a
target (assistant / completion text) and ``IGNORE_INDEX`` otherwise; the loss shifts by one itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


@dataclass(frozen=True)
class Example:
    """One tokenised row. ``input_ids`` and ``labels`` have equal length."""

    input_ids: list[int]
    labels: list[int]

    @property
    def n_targets(self) -> int:
        """Tokens that contribute to the loss (position 0 has nothing before it to predict it from)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass(frozen=True)
class Batch:
    """Right-padded batch; every tensor is ``(batch, seq)`` and int64."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))


def encode_rows(
    rows: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, max_seq_len: int
) -> list[Example]:
    """Encode rows, truncate each to ``max_seq_len`` tokens and drop rows with no target token left.

    Raises:
        ValueError: a row that is neither a chat row nor a prompt/completion row, or a chat template
            that does not render conversations prefix by prefix.
    """
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
    examples = []
    for row in rows:
        input_ids, labels = encode_row(row, tokenizer)
        example = Example(input_ids[:max_seq_len], labels[:max_seq_len])
        if example.n_targets > 0:
            examples.append(example)
    if len(examples) < len(rows):
        logger.info("dropped %d of %d rows with no target tokens", len(rows) - len(examples), len(rows))
    return examples


def encode_row(row: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one row, untruncated."""
    if "messages" in row:
        return _encode_chat(row["messages"], tokenizer)
    if "prompt" in row and "completion" in row:
        return _encode_prompt_completion(str(row["prompt"]), str(row["completion"]), tokenizer)
    raise ValueError(f"row has neither 'messages' nor 'prompt'/'completion': keys {sorted(row)}")


def eval_prompt(row: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], str]:
    """``(prompt ids, reference answer)`` of a validation row for a generative metric (common/metrics.py): a chat
    row's conversation up to its last assistant turn, rendered with the generation prompt, and that turn's
    content; a prompt/completion row's prompt (as training encodes it) and its completion."""
    if "messages" in row:
        messages = row["messages"]
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise ValueError("a chat row without an assistant turn has no reference answer")
        return encode_prompt(tokenizer, messages=messages[:last]), str(messages[last].get("content", ""))
    if "prompt" in row and "completion" in row:
        return encode_prompt(tokenizer, prompt=str(row["prompt"])), str(row["completion"])
    raise ValueError(f"row has neither 'messages' nor 'prompt'/'completion': keys {sorted(row)}")


def encode_prompt(tokenizer: PreTrainedTokenizerBase, *, messages: Sequence[Mapping[str, Any]] | None = None,
                  prompt: str | None = None) -> list[int]:
    """The tokens an answer follows, as training encodes them: a conversation rendered with the generation prompt,
    or a prompt with the tokenizer's own leading specials (a trailing eos left off, as ``_encode_prompt_completion``
    does). Used for a metric's validation rows and for sampling (worker/sampler.py)."""
    if messages is not None:
        return _tokenize(tokenizer, _render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)
    ids = _tokenize(tokenizer, prompt or "", add_special_tokens=True)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return ids


def _encode_chat(
    messages: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], list[int]]:
    """Render the conversation prefix by prefix; label only what each assistant turn adds.

    For assistant turn ``i`` the text between ``render(messages[:i], add_generation_prompt=True)`` and
    ``render(messages[:i+1])`` is that turn's content plus the template's end-of-turn marker, which is
    exactly what the model must learn to generate. Each segment is tokenised on its own: segment edges
    sit at special tokens / newlines, which GPT-2-style pre-tokenisers split off anyway, so the ids equal
    those of the whole rendered text (tested for the tiny tokenizer and SmolLM2's).
    Text after the last assistant turn is left out: a causal model learns nothing from it.
    """
    segments: list[tuple[str, bool]] = []  # (text, is_target)
    rendered = ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (prompt.startswith(rendered) and full.startswith(prompt)):
            raise ValueError("chat template is not prefix-stable: a later turn re-renders earlier text")
        segments += [(prompt[len(rendered) :], False), (full[len(prompt) :], True)]
        rendered = full

    input_ids: list[int] = []
    labels: list[int] = []
    for text, is_target in segments:
        ids = _tokenize(tokenizer, text, add_special_tokens=False)
        input_ids += ids
        labels += ids if is_target else [IGNORE_INDEX] * len(ids)
    return input_ids, labels


def _encode_prompt_completion(
    prompt: str, completion: str, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], list[int]]:
    """Prompt (with the tokenizer's own leading specials, e.g. BOS) masked; completion + eos trained."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos token to end completions with")
    prompt_ids = _tokenize(tokenizer, prompt, add_special_tokens=True)
    if prompt_ids and prompt_ids[-1] == eos:  # tokenizers that append eos on every encode
        prompt_ids = prompt_ids[:-1]
    completion_ids = [*_tokenize(tokenizer, completion, add_special_tokens=False), int(eos)]
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool
) -> str:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def _tokenize(tokenizer: PreTrainedTokenizerBase, text: str, *, add_special_tokens: bool) -> list[int]:
    if not text:
        return []
    return [int(i) for i in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]


class BatchSampler:
    """Endless stream of row indices in a seeded order, reshuffled every epoch.

    Batches are cut from the concatenation of epoch permutations, so a batch may straddle two epochs
    and no row is ever skipped. The generator is private to one trial: a trial draws the same batches
    whether it trains alone or in a pack.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int) -> None:
        if n_rows < 1 or batch_size < 1:
            raise ValueError(f"need n_rows >= 1 and batch_size >= 1, got {n_rows} and {batch_size}")
        self.n_rows, self.batch_size = n_rows, batch_size
        self._generator = torch.Generator().manual_seed(seed)
        self._pending: list[int] = []

    def next_indices(self) -> list[int]:
        indices = self.peek()
        self._pending = self._pending[self.batch_size :]
        return indices

    def peek(self) -> list[int]:
        """The indices ``next_indices()`` will return, without consuming them.

        Refilling the pending list advances the generator, but the stream of future indices (pending,
        then later permutations) stays the same, so a checkpoint taken after a peek resumes identically.
        """
        while len(self._pending) < self.batch_size:
            self._pending += torch.randperm(self.n_rows, generator=self._generator).tolist()
        return self._pending[: self.batch_size]

    def state(self) -> tuple[torch.Tensor, list[int]]:
        """The cursor, for checkpoints: the generator's state (uint8) and the drawn but unused indices."""
        return self._generator.get_state(), list(self._pending)

    def load_state(self, generator_state: torch.Tensor, pending: list[int]) -> None:
        """Continue exactly where ``state()`` was taken."""
        if any(not 0 <= i < self.n_rows for i in pending):
            raise ValueError(f"sampler state refers to rows outside [0, {self.n_rows})")
        self._generator.set_state(generator_state)
        self._pending = list(pending)


def collate(examples: Sequence[Example], pad_token_id: int, pad_to_multiple: int = 1) -> Batch:
    """Right-pad to the longest example, rounded up to ``pad_to_multiple``; padding has attention 0 and
    label ``IGNORE_INDEX``. Rounding (64 on CUDA) bounds the number of distinct sequence widths, so the
    attention backend's per-width plans are built once instead of on most steps."""
    longest = max(len(e.input_ids) for e in examples)
    width = -(-longest // pad_to_multiple) * pad_to_multiple
    # One tensor per field from padded lists: a tensor per row costs ~30 us each on the host.
    input_ids = torch.tensor([e.input_ids + [pad_token_id] * (width - len(e.input_ids)) for e in examples])
    labels = torch.tensor([e.labels + [IGNORE_INDEX] * (width - len(e.labels)) for e in examples])
    lengths = torch.tensor([len(e.input_ids) for e in examples])
    attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return Batch(input_ids.long(), attention_mask, labels.long())
