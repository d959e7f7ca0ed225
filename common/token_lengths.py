"""Each row's token length as the worker encodes it (worker/engine/data.py `encode_rows`), without torch or
transformers: the API counts with `tokenizers` and renders chat rows with `jinja2`, as transformers' chat templates
do, so that a task whose `max_seq_len` would leave rows without a target token is refused before anything runs.

Per row two numbers (`RowLength`): its tokens untruncated, and the shortest `max_seq_len` that leaves it a target
token (the worker drops a row with none). A file's lengths (`FileLengths`) keep both as histograms, so that any
`max_seq_len` is judged without the rows (`Truncation`). Pure but for the template's compilation (cached).
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# Rows counted per file and model: the first ones, at most this many (the lengths of a larger file are those of its
# first rows; the answers say so). Bounds the work of a submission that counts a file for the first time.
MAX_COUNTED_ROWS = 10_000


@dataclass(frozen=True)
class ChatTokenizer:
    """A model's tokenizer as the API counts with it: the backend (the same `tokenizers` object transformers wraps),
    the chat template and the special tokens the template sees (transformers' `special_tokens_map`)."""

    backend: Tokenizer
    chat_template: str | None
    special_tokens: Mapping[str, str]  # "bos_token", "eos_token", ... -> the token's text
    eos_token_id: int | None
    fingerprint: str  # what the lengths counted with it are stored under: changes when the tokenizer does


@dataclass(frozen=True)
class RowLength:
    tokens: int  # the row's tokens, untruncated
    needed: int  # the shortest max_seq_len that leaves the row a target token; 0: none at any length


def row_length(row: Mapping[str, Any], tok: ChatTokenizer) -> RowLength:
    """One row's lengths, as `encode_row` encodes it (the same segments, each tokenised on its own).

    Raises:
        ValueError: a row of neither format, or a chat template that is not prefix-stable (as `encode_row`).
        jinja2.TemplateError: the template refuses the conversation.
    """
    if "chosen" in row and "rejected" in row:
        return _preference_length(row, tok)
    if "messages" in row:
        segments = _chat_segments(row["messages"], tok)
    elif "prompt" in row and "completion" in row:
        segments = _prompt_completion_segments(str(row["prompt"]), str(row["completion"]), tok)
    else:
        raise ValueError(f"row has neither 'messages' nor 'prompt'/'completion': keys {sorted(row)}")
    return _length(segments)


def _preference_length(row: Mapping[str, Any], tok: ChatTokenizer) -> RowLength:
    """A preference row's (worker/engine/dpo.py `encode_preference_row`): the longer of its two sequences (the prompt
    and each answer), and the `max_seq_len` that leaves both answers a target token (a pair without one on either
    side is dropped). In the chat form the prompt's own assistant turns are context, not targets."""
    lengths = []
    for name in ("chosen", "rejected"):
        if "messages" in row:
            answer = row[name] if isinstance(row[name], list) else [row[name]]
            segments = _chat_segments([*row["messages"], *answer], tok)
            context = _count(tok, _render(tok, row["messages"], add_generation_prompt=True))
            lengths.append(_length(segments, context=context))
        else:
            lengths.append(_length(_prompt_completion_segments(str(row["prompt"]), str(row[name]), tok)))
    needed = 0 if any(x.needed == 0 for x in lengths) else max(x.needed for x in lengths)
    return RowLength(tokens=max(x.tokens for x in lengths), needed=needed)


def _length(segments: Sequence[tuple[int, bool]], *, context: int = 0) -> RowLength:
    """The length of a row of ``segments`` (tokens, is_target); targets among its first ``context`` tokens do not
    count."""
    position, needed = 0, 0
    for n, is_target in segments:
        # A target at position p counts once max_seq_len > p, and position 0 never counts (Example.n_targets).
        first = max(position, 1, context)
        if is_target and not needed and first < position + n:
            needed = first + 1
        position += n
    return RowLength(tokens=position, needed=needed)


def _chat_segments(messages: Sequence[Mapping[str, Any]], tok: ChatTokenizer) -> list[tuple[int, bool]]:
    """`_encode_chat`'s segments as (tokens, is_target): each assistant turn's prompt prefix, then what it adds."""
    if tok.chat_template is None:
        raise ValueError("the model has no chat template to render chat rows")
    segments: list[tuple[int, bool]] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = _render(tok, messages[:i], add_generation_prompt=True)
        full = _render(tok, messages[: i + 1], add_generation_prompt=False)
        if not (prompt.startswith(rendered) and full.startswith(prompt)):
            raise ValueError("chat template is not prefix-stable: a later turn re-renders earlier text")
        segments += [(_count(tok, prompt[len(rendered):]), False), (_count(tok, full[len(prompt):]), True)]
        rendered = full
    return segments


def _prompt_completion_segments(prompt: str, completion: str, tok: ChatTokenizer) -> list[tuple[int, bool]]:
    """`_encode_prompt_completion`'s: the prompt with the tokenizer's own specials (less a trailing eos), then the
    completion and eos."""
    if tok.eos_token_id is None:
        raise ValueError("tokenizer has no eos token to end completions with")
    prompt_ids = tok.backend.encode(prompt, add_special_tokens=True).ids if prompt else []
    if prompt_ids and prompt_ids[-1] == tok.eos_token_id:
        prompt_ids = prompt_ids[:-1]
    return [(len(prompt_ids), False), (_count(tok, completion) + 1, True)]


def _count(tok: ChatTokenizer, text: str) -> int:
    """Tokens of a segment, without the tokenizer's own specials (`_tokenize(add_special_tokens=False)`)."""
    return len(tok.backend.encode(text, add_special_tokens=False).ids) if text else 0


def _render(tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
    """transformers' `apply_chat_template(tokenize=False)`: the template sees the messages, no tools or documents,
    the generation flag and the special tokens by name."""
    assert tok.chat_template is not None
    return compiled_template(tok.chat_template).render(
        messages=[dict(m) for m in messages], tools=None, documents=None,
        add_generation_prompt=add_generation_prompt, **tok.special_tokens)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark assistant text): its body, as rendered."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compiled_template(template: str) -> jinja2.Template:
    """The chat template compiled as transformers compiles it (a sandbox, trim_blocks and lstrip_blocks, loop
    controls, its `tojson`, `raise_exception` and `strftime_now`)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# ---- a file's lengths and what a max_seq_len does to them -------------------------------------------------------

Histogram = tuple[tuple[int, int], ...]  # (value, rows), ascending by value


@dataclass(frozen=True)
class FileLengths:
    """A file's row lengths for one model: histograms of `RowLength.tokens` and `.needed` over the rows counted
    (the first `MAX_COUNTED_ROWS`), and how many rows the file has."""

    counted: int
    total: int
    tokens: Histogram
    needed: Histogram

    @classmethod
    def of(cls, lengths: Iterable[RowLength], total: int) -> FileLengths:
        tokens: Counter[int] = Counter()
        needed: Counter[int] = Counter()
        for length in lengths:
            tokens[length.tokens] += 1
            needed[length.needed] += 1
        return cls(counted=sum(tokens.values()), total=total, tokens=tuple(sorted(tokens.items())),
                   needed=tuple(sorted(needed.items())))

    def to_stored(self) -> dict[str, Any]:
        return {"counted": self.counted, "total": self.total, "tokens": [list(p) for p in self.tokens],
                "needed": [list(p) for p in self.needed]}

    @classmethod
    def from_stored(cls, data: Mapping[str, Any]) -> FileLengths:
        return cls(counted=int(data["counted"]), total=int(data["total"]),
                   tokens=tuple((int(v), int(n)) for v, n in data["tokens"]),
                   needed=tuple((int(v), int(n)) for v, n in data["needed"]))

    @property
    def capped(self) -> bool:
        return self.counted < self.total


@dataclass(frozen=True)
class Truncation:
    """What `max_seq_len` does to a file's counted rows."""

    max_seq_len: int
    counted: int
    without_target: int  # rows left no target token: the worker drops them
    shortened: int  # rows that lose tokens but keep a target
    p50: int  # tokens per row, untruncated
    p90: int
    longest: int  # also the smallest max_seq_len that truncates no counted row
    shortest_working: int  # the smallest max_seq_len that leaves every counted row a target token


def truncation(lengths: FileLengths, max_seq_len: int) -> Truncation:
    """Pure: the rows `max_seq_len` leaves without a target token or shortens, and the lengths' percentiles."""
    over_tokens = _rows_above(lengths.tokens, max_seq_len)
    # `needed` 0 never happens for a valid row (each has a non-empty target); counted as no target at any length.
    without = _rows_above(lengths.needed, max_seq_len) + dict(lengths.needed).get(0, 0)
    return Truncation(
        max_seq_len=max_seq_len, counted=lengths.counted, without_target=without, shortened=over_tokens - without,
        p50=percentile(lengths.tokens, 50), p90=percentile(lengths.tokens, 90),
        longest=lengths.tokens[-1][0] if lengths.tokens else 0,
        shortest_working=max((v for v, _ in lengths.needed), default=0),
    )


def _rows_above(histogram: Histogram, limit: int) -> int:
    values = [v for v, _ in histogram]
    return sum(n for _, n in histogram[bisect.bisect_right(values, limit):])


def percentile(histogram: Histogram, percent: int) -> int:
    """The nearest-rank percentile (1 <= percent <= 100) of a histogram's values; 0 for an empty one."""
    total = sum(n for _, n in histogram)
    if total == 0:
        return 0
    rank, seen = max(1, -(-percent * total // 100)), 0
    for value, n in histogram:
        seen += n
        if seen >= rank:
            return value
    return histogram[-1][0]
