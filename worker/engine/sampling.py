"""Sampling from trained adapters (issue 35): requests under many adapters of one base model decoded together, the
engine's own trick applied to decoding. Every LoRA layer runs the grouped path (``kernels.lora_linear``: each token
under its own adapter, in one op), so a batch of requests over eight adapters costs one forward per new token, not
eight; and a KV cache keeps each step to the new tokens.

The batch's prompts are left-padded into one ``(rows, T)`` batch, its rows ordered by adapter, so that each adapter's
rows are one contiguous segment of the flattened tokens (``kernels.segments``). A request without an adapter (the
base model, for comparison) gets a slot of zeros. Each step feeds every open row's newest token; a row that finished
is dropped from the batch and from the cache, so the long answers do not carry the short ones.

Sampling: greedy at temperature 0; otherwise the temperature-scaled distribution cut to its top-p nucleus, drawn by
inverse CDF with one uniform number per row per step from the request's own seeded generator (``random.Random``), so
a request's answer depends on its seed and not on what it was batched with (up to the batch's float rounding).

Pure engine: the caller (worker/sampler.py) owns the model, the adapters, the prompts' tokens and the stop strings.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from kernels import build_segments
from worker.engine.lora import LoraConfig, LoraContext, TokenRouting, inject_lora, restore_base_model

ModuleTensors = dict[str, tuple[torch.Tensor, torch.Tensor]]  # {path: (A (r, d_in), B (d_out, r))}, PEFT layout

FINISH_STOP = "stop"  # a stop token or stop string ended the answer
FINISH_LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter ready to sample under: its config and ``{module path: (A (r, d_in), B (d_out, r))}`` on the
    model's device and dtype. ``key`` names it (its archive's key in the store): requests with the same key share
    a slot."""

    key: str
    config: LoraConfig
    tensors: ModuleTensors


@dataclass
class SampleJob:
    """One request: its prompt's tokens, the adapter it runs under (None: the base model) and how it samples."""

    prompt_ids: list[int]
    adapter: Adapter | None
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    tokens: list[int] = field(default_factory=list)  # the answer so far
    finish_reason: str | None = None


# Called with (job index, its new token) as each token is chosen; False ends the job there (a stop string).
OnToken = Callable[[int, int], bool]


@torch.no_grad()
def sample(model: PreTrainedModel, jobs: Sequence[SampleJob], *, stop_ids: frozenset[int], pad_token_id: int,
           on_token: OnToken | None = None) -> None:
    """Decodes every job to its end together: each job's ``tokens`` and ``finish_reason`` are filled in.

    A job ends at a token of ``stop_ids`` (not kept; ``stop``), when ``on_token`` says so (the token kept; ``stop``)
    or after ``max_tokens`` tokens (``length``). ``model`` must have no LoRA layers: the batch's adapters are wrapped
    around its layers for the call and taken off after.
    """
    open_rows = sorted(range(len(jobs)), key=lambda i: _adapter_order(jobs[i]))
    open_rows = [i for i in open_rows if jobs[i].max_tokens > 0 and jobs[i].prompt_ids]
    for job in jobs:
        job.tokens, job.finish_reason = [], None if job.max_tokens > 0 and job.prompt_ids else FINISH_LENGTH
    if not open_rows:
        return
    device = next(model.parameters()).device
    context = LoraContext()
    slots = _install_adapters(model, [jobs[i] for i in open_rows], context, device)
    rngs = {i: random.Random(jobs[i].seed) for i in open_rows}
    try:
        ids, mask = _left_padded([jobs[i].prompt_ids for i in open_rows], pad_token_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        while open_rows:
            row_slots = [slots.get(_key(jobs[i]), 0) for i in open_rows]
            logits = _forward(model, context, ids, mask, positions, cache, row_slots, len(slots))
            chosen = _choose(logits, [jobs[i] for i in open_rows], [rngs[i] for i in open_rows])
            kept = [row for row, (i, token) in enumerate(zip(open_rows, chosen, strict=True))
                    if _take(jobs[i], i, token, stop_ids, on_token)]
            if not kept:
                break
            if len(kept) < len(open_rows):
                index = torch.tensor(kept, device=device)
                cache.reorder_cache(index)  # type: ignore[arg-type]  # a LongTensor is an int64 Tensor
                mask, positions = mask[index], positions[index]
            open_rows = [open_rows[row] for row in kept]
            ids = torch.tensor([[jobs[i].tokens[-1]] for i in open_rows], device=device)
            mask = torch.cat([mask, mask.new_ones(len(open_rows), 1)], dim=1)
            positions = positions[:, -1:] + 1
    finally:
        if slots:
            restore_base_model(model)


def _key(job: SampleJob) -> str | None:
    return None if job.adapter is None else job.adapter.key


def _adapter_order(job: SampleJob) -> tuple[int, str]:
    return (0, "") if job.adapter is None else (1, job.adapter.key)


def _take(job: SampleJob, index: int, token: int, stop_ids: frozenset[int], on_token: OnToken | None) -> bool:
    """Records ``token`` as the job's next; whether the job goes on."""
    if token in stop_ids:
        job.finish_reason = FINISH_STOP
        return False
    job.tokens.append(token)
    if on_token is not None and not on_token(index, token):
        job.finish_reason = FINISH_STOP
        return False
    if len(job.tokens) >= job.max_tokens:
        job.finish_reason = FINISH_LENGTH
        return False
    return True


def _install_adapters(model: PreTrainedModel, jobs: list[SampleJob], context: LoraContext,
                      device: torch.device) -> dict[str | None, int]:
    """Wraps every layer an adapter of ``jobs`` targets and gives each adapter a slot of stacked weights (rank
    padded with zeros; a layer an adapter does not target has scale 0 there); the base model's rows a slot of
    zeros. Returns ``{adapter key (None: the base): slot}``, empty when no job has an adapter (nothing wrapped)."""
    adapters = list({j.adapter.key: j.adapter for j in jobs if j.adapter is not None}.values())
    if not adapters:
        return {}
    slots: dict[str | None, int] = {a.key: z for z, a in enumerate(adapters)}
    slots[None] = len(adapters)
    paths = sorted({p for a in adapters for p in a.tensors})
    layers = inject_lora(model, paths, context)
    dtype = next(model.parameters()).dtype
    r_max = max(a.config.rank for a in adapters)
    for layer in layers:
        lora_a = torch.zeros(len(slots), layer.in_features, r_max, dtype=dtype, device=device)
        lora_b = torch.zeros(len(slots), r_max, layer.out_features, dtype=dtype, device=device)
        scale = torch.zeros(len(slots), dtype=torch.float32, device=device)
        for z, adapter in enumerate(adapters):
            if layer.path in adapter.tensors:
                a, b = adapter.tensors[layer.path]
                lora_a[z, :, : a.shape[0]] = a.T
                lora_b[z, : b.shape[1]] = b.T
                scale[z] = adapter.config.scale
        layer.lora_a, layer.lora_b, layer.scale, layer.enabled = lora_a, lora_b, scale, True
    return slots


def _left_padded(prompts: list[list[int]], pad_token_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _forward(model: PreTrainedModel, context: LoraContext, ids: torch.Tensor, mask: torch.Tensor,
             positions: torch.Tensor, cache: DynamicCache, row_slots: list[int], num_slots: int) -> torch.Tensor:
    """The next-token logits ``(rows, vocab)`` in float32, each row under its slot's adapter (``num_slots`` 0: no
    adapters wrapped, the base alone)."""
    width = ids.shape[1]
    runs: list[tuple[int, int]] = []  # (slot, tokens): consecutive rows of one slot make one segment
    for slot in row_slots:
        if runs and runs[-1][0] == slot:
            runs[-1] = (slot, runs[-1][1] + width)
        else:
            runs.append((slot, width))
    routing = None
    if num_slots:
        meta = build_segments([s for s, _ in runs], [n for _, n in runs], num_slots=num_slots, device=ids.device)
        routing = TokenRouting(meta)
    with context.routed(routing):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float()


def _choose(logits: torch.Tensor, jobs: list[SampleJob], rngs: list[random.Random]) -> list[int]:
    """Each row's next token: the argmax at temperature 0, else a draw from its top-p nucleus (one uniform number
    from the job's own generator)."""
    greedy = logits.argmax(-1)
    temperatures = [job.temperature for job in jobs]
    if all(t <= 0 for t in temperatures):
        return [int(t) for t in greedy.tolist()]
    device = logits.device
    temps = torch.tensor([max(t, 1e-6) for t in temperatures], device=device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_p.cumsum(-1)
    top_p = torch.tensor([job.top_p for job in jobs], device=device)
    nucleus = torch.where(cumulative - sorted_p < top_p[:, None], sorted_p, torch.zeros_like(sorted_p))
    kept = nucleus.cumsum(-1)
    draws = torch.tensor([rng.random() for rng in rngs], device=device, dtype=kept.dtype) * kept[:, -1]
    picks = torch.searchsorted(kept, draws[:, None]).clamp(max=kept.shape[-1] - 1)
    sampled = order.gather(-1, picks).squeeze(-1)
    return [int(g) if t <= 0 else int(s)
            for g, s, t in zip(greedy.tolist(), sampled.tolist(), temperatures, strict=True)]
