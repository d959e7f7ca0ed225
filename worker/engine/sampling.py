"""Sampling from trained adapters (issue 35): requests under many adapters of one base model decoded together, the
engine's own trick applied to decoding: one forward per new token for the whole batch, each row under its own
adapter, with a KV cache.

Each adapted linear layer of the batch computes, for every row ``b`` of the ``(rows, tokens, d_in)`` activations,
``W x + scale_b · (x A_b) B_b`` with two batched matmuls over the rows, each row's ``A_b`` / ``B_b`` gathered once for
the batch from the stacked adapters (``RowLoraLinear``; Punica's BGMV, Chen et al. 2023, the shape vLLM's and
S-LoRA's decoding kernels take). The rows are gathered again only when finished rows leave the batch. Why not the
training path (``kernels.lora_linear`` over token segments): it runs an autograd Function and a segment layout per
layer per call, and decoding a small model is host-bound: on an H200, SmolLM2-135M's shape, one request under one
adapter decoded at 78 ms a token through it against 45 ms for PEFT (benchmarks/sampling.py; docs/sampling.md).

The batch's prompts are left-padded into one ``(rows, T)`` batch. A request without an adapter (the base model, for
comparison) gets a slot of zeros. Each step feeds every open row's newest token; a row that finished is dropped from
the batch and from the cache, so the long answers do not carry the short ones.

Sampling: greedy at temperature 0; otherwise the temperature-scaled distribution cut to its top-p nucleus, drawn by
inverse CDF with one uniform number per row per step from the request's own seeded generator (``random.Random``), so
a request's answer depends on its seed and not on what it was batched with (up to the batch's float rounding).

Pure engine: the caller (worker/sampler.py) owns the model, the adapters, the prompts' tokens and the stop strings.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from worker.engine.lora import LoraConfig
from worker.engine.store import ModuleTensors

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
    open_rows = [i for i, job in enumerate(jobs) if job.max_tokens > 0 and job.prompt_ids]
    for job in jobs:
        job.tokens, job.finish_reason = [], None if job.max_tokens > 0 and job.prompt_ids else FINISH_LENGTH
    if not open_rows:
        return
    device = next(model.parameters()).device
    rows = _install_adapters(model, [jobs[i] for i in open_rows], device)
    rngs = {i: random.Random(jobs[i].seed) for i in open_rows}
    try:
        ids, mask = _left_padded([jobs[i].prompt_ids for i in open_rows], pad_token_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        cache_arg = _cache_argument(model)
        while open_rows:
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                        **{cache_arg: cache})
            chosen = _choose(out.logits[:, -1, :].float(), [jobs[i] for i in open_rows], [rngs[i] for i in open_rows])
            kept = [row for row, (i, token) in enumerate(zip(open_rows, chosen, strict=True))
                    if _take(jobs[i], i, token, stop_ids, on_token)]
            if not kept:
                break
            if len(kept) < len(open_rows):
                index = torch.tensor(kept, device=device)
                cache.reorder_cache(index)  # type: ignore[arg-type]  # a LongTensor is an int64 Tensor
                mask, positions = mask[index], positions[index]
                if rows is not None:
                    rows.keep(index)
            open_rows = [open_rows[row] for row in kept]
            ids = torch.tensor([[jobs[i].tokens[-1]] for i in open_rows], device=device)
            mask = torch.cat([mask, mask.new_ones(len(open_rows), 1)], dim=1)
            positions = positions[:, -1:] + 1
    finally:
        if rows is not None:
            _remove_adapters(model)


def _cache_argument(model: PreTrainedModel) -> str:
    """The forward's name for the KV cache: ``cache`` from transformers 5.2x (``past_key_values`` deprecated there,
    to go in 5.40), ``past_key_values`` before (5.17, the GPU image's)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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


class BatchRows:
    """The slot of each row of the batch, shared by every ``RowLoraLinear`` of the model; ``version`` changes when
    rows leave, so that each layer gathers its rows' adapters again."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots, self.version = slots, 0

    def keep(self, index: torch.Tensor) -> None:
        self.slots, self.version = self.slots.index_select(0, index), self.version + 1


class RowLoraLinear(nn.Module):
    """A frozen linear layer plus each row's own adapter: ``W x + b + scale_r · (x A_r) B_r`` for the rows ``r`` of
    ``(rows, tokens, d_in)`` activations. ``lora_a (Z, d_in, r_max)``, ``lora_b (Z, r_max, d_out)`` and ``scale (Z,)``
    stack the batch's adapters by slot (rank padded with zeros, scale 0 where an adapter leaves this layer out)."""

    def __init__(self, base_layer: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor,
                 rows: BatchRows) -> None:
        super().__init__()
        self.base_layer, self.rows = base_layer, rows
        self.lora_a, self.lora_b, self.scale = lora_a, lora_b, scale
        self._gathered: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (rows' version, A·scale, B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self._gathered is None or self._gathered[0] != self.rows.version:
            slots = self.rows.slots
            scaled_a = self.lora_a.index_select(0, slots) * self.scale.index_select(0, slots).to(x.dtype)[:, None, None]
            self._gathered = (self.rows.version, scaled_a, self.lora_b.index_select(0, slots))
        _, a, b = self._gathered
        flat = x.reshape(x.shape[0], -1, x.shape[-1])  # (rows, tokens, d_in)
        delta = torch.bmm(torch.bmm(flat, a), b)
        return out + delta.view(*x.shape[:-1], -1)


def _install_adapters(model: PreTrainedModel, jobs: list[SampleJob], device: torch.device) -> BatchRows | None:
    """Wraps every layer an adapter of ``jobs`` targets in a ``RowLoraLinear``, each adapter in a slot (the base
    model's rows a slot of zeros); the rows' slots, in ``jobs``' order. None (nothing wrapped) when no job has an
    adapter."""
    adapters = list({j.adapter.key: j.adapter for j in jobs if j.adapter is not None}.values())
    if not adapters:
        return None
    slots: dict[str | None, int] = {a.key: z for z, a in enumerate(adapters)}
    slots[None] = len(adapters)
    rows = BatchRows(torch.tensor([slots[j.adapter.key if j.adapter else None] for j in jobs], device=device))
    dtype = next(model.parameters()).dtype
    r_max = max(a.config.rank for a in adapters)
    for path in sorted({p for a in adapters for p in a.tensors}):
        layer = model.get_submodule(path)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"the adapter's layer {path} is not a linear layer of {type(model).__name__}")
        lora_a = torch.zeros(len(slots), layer.in_features, r_max, dtype=dtype, device=device)
        lora_b = torch.zeros(len(slots), r_max, layer.out_features, dtype=dtype, device=device)
        scale = torch.zeros(len(slots), dtype=torch.float32, device=device)
        for z, adapter in enumerate(adapters):
            if path in adapter.tensors:
                a, b = adapter.tensors[path]
                lora_a[z, :, : a.shape[0]] = a.T
                lora_b[z, : b.shape[1]] = b.T
                scale[z] = adapter.config.scale
        model.set_submodule(path, RowLoraLinear(layer, lora_a, lora_b, scale, rows))
    return rows


def _remove_adapters(model: PreTrainedModel) -> None:
    for path, module in list(model.named_modules()):
        if isinstance(module, RowLoraLinear):
            model.set_submodule(path, module.base_layer)


def _left_padded(prompts: list[list[int]], pad_token_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


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
