"""Encoding (what is a target token), truncation, seeded batch order and padding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine.data import IGNORE_INDEX, BatchSampler, Example, collate, encode_row, encode_rows

Tiny = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def _targets(tokenizer: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int]) -> list[str]:
    """Decoded runs of consecutive target tokens."""
    runs: list[list[int]] = []
    for i, (token, label) in enumerate(zip(input_ids, labels, strict=True)):
        if label == IGNORE_INDEX:
            continue
        assert label == token
        if runs and labels[i - 1] != IGNORE_INDEX:
            runs[-1].append(token)
        else:
            runs.append([token])
    return [str(tokenizer.decode(run)) for run in runs]


def test_chat_rows_train_only_assistant_turns(tiny: Tiny) -> None:
    _, tokenizer = tiny
    row = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"},
        ]
    }
    input_ids, labels = encode_row(row, tokenizer)
    full = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert _targets(tokenizer, input_ids, labels) == ["4<|im_end|>\n", "6<|im_end|>\n"]


def test_text_after_the_last_assistant_turn_is_left_out(tiny: Tiny) -> None:
    _, tokenizer = tiny
    row = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "trailing question"},
        ]
    }
    input_ids, labels = encode_row(row, tokenizer)
    assert tokenizer.decode(input_ids) == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
    assert _targets(tokenizer, input_ids, labels) == ["b<|im_end|>\n"]


def test_prompt_completion_masks_prompt_and_trains_completion_and_eos(tiny: Tiny) -> None:
    _, tokenizer = tiny
    input_ids, labels = encode_row({"prompt": "Q: hi", "completion": " A: yo"}, tokenizer)
    assert input_ids == [*b"Q: hi", *b" A: yo", 258]
    assert labels == [IGNORE_INDEX] * 5 + [*b" A: yo", 258]


def test_truncation_and_rows_without_targets(tiny: Tiny) -> None:
    _, tokenizer = tiny
    rows: list[dict[str, Any]] = [
        {"prompt": "abc", "completion": "defg"},  # 3 prompt + 5 target tokens
        {"prompt": "x" * 10, "completion": "y"},  # completion cut off entirely by max_seq_len 6
        {"messages": [{"role": "user", "content": "no answer"}]},  # nothing to learn
    ]
    examples = encode_rows(rows, tokenizer, max_seq_len=6)
    assert examples == [Example([*b"abcdef"], [IGNORE_INDEX] * 3 + [*b"def"])]
    assert examples[0].n_targets == 3


def test_first_token_is_never_a_target(tiny: Tiny) -> None:
    _, tokenizer = tiny
    # Position 0 has no context to be predicted from, so only the eos after "z" counts.
    (example,) = encode_rows([{"prompt": "", "completion": "z"}], tokenizer, max_seq_len=2)
    assert example.input_ids == [ord("z"), 258] and example.n_targets == 1
    # An empty completion leaves just [eos] at position 0: nothing to learn, dropped.
    assert encode_rows([{"prompt": "", "completion": ""}], tokenizer, max_seq_len=8) == []


def test_bad_rows_raise(tiny: Tiny) -> None:
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="neither 'messages' nor 'prompt'/'completion'"):
        encode_rows([{"text": "free text"}], tokenizer, max_seq_len=8)


def test_batch_sampler_is_seeded_covers_each_epoch_and_cycles() -> None:
    draws = [BatchSampler(5, 2, seed=3).next_indices() for _ in range(2)]
    assert draws[0] == draws[1]
    sampler = BatchSampler(5, 2, seed=3)
    stream = [i for _ in range(5) for i in sampler.next_indices()]  # two epochs exactly
    assert sorted(stream[:5]) == sorted(stream[5:]) == [0, 1, 2, 3, 4]
    assert stream[:5] != stream[5:]  # reshuffled (pinned for seed 3)
    other = BatchSampler(5, 2, seed=4)
    assert [i for _ in range(5) for i in other.next_indices()] != stream
    assert BatchSampler(2, 5, seed=0).next_indices().count(0) >= 2  # batch larger than the data


def test_collate_pads_right_with_mask_and_ignored_labels() -> None:
    batch = collate([Example([1, 2, 3], [-100, 2, 3]), Example([4], [4])], pad_token_id=9)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.labels.tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch.input_ids.dtype == torch.long


def test_collate_rounds_the_width_up_to_a_multiple() -> None:
    batch = collate([Example([1, 2, 3], [-100, 2, 3]), Example([4], [4])], pad_token_id=9, pad_to_multiple=4)
    assert batch.input_ids.tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch.labels[:, 3].tolist() == [-100, -100]
    exact = collate([Example([1, 2, 3, 4], [1, 2, 3, 4])], pad_token_id=9, pad_to_multiple=4)
    assert exact.input_ids.shape == (1, 4)  # already a multiple: no extra column
