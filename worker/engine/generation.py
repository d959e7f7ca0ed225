"""Greedy decoding under each slot's current adapter, for a trial's generative metric (``generate``; the trainer's
``_score``) and for checking what an adapter reproduces (``greedy_matches``): every slot's rows in shared packed
forwards, no KV cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from worker.engine.batch import SlotRows
from worker.engine.data import IGNORE_INDEX, Example
from worker.engine.pack_engine import PackEngine
from worker.engine.passes import EVAL_MAX_TOKENS, ModelPasses


@torch.no_grad()
def generate(
    engine: PackEngine, prompts: dict[int, list[list[int]]], *, max_new_tokens: int, stop_ids: frozenset[int]
) -> dict[int, list[list[int]]]:
    """Greedy continuations of each slot's prompts under the slot's current adapter: every row of every slot
    in one packed forward per new token (no KV cache: each forward runs the rows so far, which for short
    answers on validation-sized sets costs less than keeping a cache per slot). A row ends at a token of
    ``stop_ids`` (not included) or after ``max_new_tokens``. In a pack over several GPUs every rank calls it
    at the same point, with no prompts where it has none to answer: the ranks agree on each new token's
    forwards (the module docstring of worker/engine/distributed.py).

    Returns:
        ``{slot: [new token ids per prompt]}``, in the prompts' order.
    """
    for slot in prompts:
        engine.state(slot)
    answers: dict[int, list[list[int]]] = {slot: [[] for _ in rows] for slot, rows in prompts.items()}
    open_rows = [(slot, i) for slot in sorted(prompts) for i in range(len(prompts[slot])) if prompts[slot][i]]
    lockstep = engine.lockstep
    if lockstep is not None:
        max_new_tokens = lockstep.most(max_new_tokens if open_rows else 0)
    for _ in range(max_new_tokens):
        groups = _token_groups(open_rows, lambda r: len(prompts[r[0]][r[1]]) + len(answers[r[0]][r[1]]) + 1,
                               EVAL_MAX_TOKENS) if open_rows else []
        passes = len(groups) if lockstep is None else lockstep.most(len(groups))
        if not passes:
            break
        tokens: list[int] = []
        for group in groups:
            tokens += _next_tokens(engine.passes, [(slot, prompts[slot][i] + answers[slot][i]) for slot, i in group])
        if lockstep is not None:
            lockstep.pad(engine.passes, "forward", passes - len(groups))
        still_open = []
        for (slot, i), token in zip(open_rows, tokens, strict=True):
            if token in stop_ids:
                continue
            answers[slot][i].append(token)
            still_open.append((slot, i))
        open_rows = still_open
    return answers


@torch.no_grad()
def greedy_matches(engine: PackEngine, slot: int, examples: list[Example], batch_size: int = 64) -> list[bool]:
    """Whether the slot's current adapter reproduces each example's targets under greedy decoding: every
    target token is the argmax of the logits before it (teacher-forced, so one forward per batch; the
    end-of-turn token is a target, so a completion that runs on does not match)."""
    engine.state(slot)
    model = engine.passes
    matches: list[bool] = []
    for start in range(0, len(examples), batch_size):
        batch = model.pack([SlotRows(slot, examples[start : start + batch_size])])
        hidden = model.hidden(batch)
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.targets.positions)
        correct = torch.empty(len(picked), dtype=torch.bool, device=model.device)
        for chunk in batch.targets.chunks:
            with model.context.routed(chunk.routing):
                logits = model.lm_head(picked[chunk.start : chunk.end])
            correct[chunk.start : chunk.end] = logits.argmax(-1) == batch.targets.labels[chunk.start : chunk.end]
        wrong = torch.zeros(batch.n_rows, dtype=torch.int64, device=model.device)
        wrong.index_add_(0, batch.targets.rows, (~correct).long())
        matches.extend(bool(w == 0) for w in wrong.tolist())
    return matches


def answer_stop_ids(engine: PackEngine) -> frozenset[int]:
    """The tokens that end a generated answer under the engine's model (``stop_token_ids``)."""
    return stop_token_ids(engine.model, engine.tokenizer)


def stop_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The tokens that end a generated answer: the tokenizer's eos and the model's generation eos (the chat
    template's end of turn, where the model says)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(configured) if isinstance(configured, list | tuple) else {configured}
    return frozenset(int(i) for i in ids if i is not None)


def _next_tokens(model: ModelPasses, rows: list[tuple[int, list[int]]]) -> list[int]:
    """The greedy next token of each ``(slot, ids)`` row (rows grouped by slot), one packed forward."""
    # Each row gets a placeholder token with a label, so that its last real token is a loss target: the
    # targets' hidden states are exactly the rows' last positions, in row order.
    parts: dict[int, list[Example]] = {}
    for slot, ids in rows:
        parts.setdefault(slot, []).append(Example([*ids, model.pad_token_id], [IGNORE_INDEX] * len(ids) + [0]))
    batch = model.pack([SlotRows(slot, examples) for slot, examples in parts.items()])
    hidden = model.hidden(batch)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.targets.positions)
    tokens = torch.empty(len(picked), dtype=torch.int64, device=model.device)
    for chunk in batch.targets.chunks:
        with model.context.routed(chunk.routing):
            tokens[chunk.start : chunk.end] = model.lm_head(picked[chunk.start : chunk.end]).argmax(-1)
    return [int(t) for t in tokens.tolist()]  # one device sync per forward


def _token_groups(rows: list[Any], length: Callable[[Any], int], max_tokens: int) -> list[list[Any]]:
    """``rows`` in order, cut into consecutive groups of at most ``max_tokens`` tokens (a longer row alone)."""
    groups: list[list[Any]] = [[]]
    used = 0
    for row in rows:
        n = length(row)
        if groups[-1] and used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(row)
        used += n
    return [g for g in groups if g]
