"""Triton kernels for a LoRA-wrapped linear layer of a pack: every slot's adapter beside the frozen GEMM.

Forward, for the tokens ``n`` of each segment of slot ``z`` (the contract of ``kernels.lora_delta``)::

    S' = scale_z · (X̂ A_z),  C = S' B_z (+ bias)    _lora_term_kernel   one launch, all slots
    Y  = X Wᵀ + C                                   cuBLAS, C added in the GEMM's epilogue (beta = 1)
Backward, given dY::

    dS = scale_z · (dY B_zᵀ),  C = (dS A_zᵀ) ⊙ K     _lora_term_kernel   (B and A read transposed through strides)
    dX = dY W + C                                   cuBLAS, beta = 1
    dB_z += S'ᵀ dY                                  _outer_kernel       per (slot, tile), over the slot's tokens
    dA_z += X̂ᵀ dS                                   _outer_kernel       dropout recomputed from the keys

The frozen GEMMs stay with cuBLAS: on an H100 a Triton GEMM with the expand inside it ran the engine slower
than cuBLAS adding a precomputed LoRA term in its epilogue (39.6k vs 40.1k tokens/s, Llama-3.2-1B, 32 trials;
``benchmarks/results/engine_throughput-llama-3.2-1b-torch-triton-fusedgemm-triton-gpu-20261122.json``):
cuBLAS's GEMM is ~20% faster than ours and reading C costs it little, as it is bound by arithmetic.

Work is driven by a table built once per step from the host copy of ``SegmentMeta`` and cached on it:
(slot, token block) pairs whose blocks never cross a segment, so there is no token padding. Padded ranks
cost only the width of one MMA; slots with scale 0 are skipped. Accumulation is fp32; fp16 and bf16 inputs
use the tensor cores, fp32 inputs IEEE fp32 dots (so fp32 results stay near 1e-6). The term kernel's tiles
are autotuned per GPU and shape (cached on disk where Triton supports it; the outer kernel, which adds into
the gradient store, takes its tiles from the shape); with ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors with one small configuration each.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.dropout import LayerDropout
from kernels.segments import SegmentMeta

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_TOKENS = 64  # token block of the schedule table
PROGRAMS_PER_SM = 2  # the term kernel's programs per SM below which a block's columns are split (lora_term)
# The interpreter's dot reads bf16 operands as raw integers (Triton 3.9): it gets them as fp32 instead.
_DOT_IN_FP32 = tl.constexpr(INTERPRET)


# LORAPLANE_TRITON_AUTOTUNE=0 runs each kernel with one fixed configuration (the GPU tests: tuning every
# new test shape costs minutes of compiling).
AUTOTUNE = os.environ.get("LORAPLANE_TRITON_AUTOTUNE", "1") != "0"


def _autotune(configs: list[triton.Config], key: list[str], fixed: int, **kwargs: Any) -> Any:
    """``triton.autotune`` with the on-disk cache where Triton has it; configuration ``fixed`` alone when
    tuning is off, the last (smallest) one under the interpreter."""
    if INTERPRET:
        configs = configs[-1:]
    elif not AUTOTUNE:
        configs = [configs[fixed]]
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **kwargs)


def _cfg(num_warps: int, num_stages: int, **meta: int) -> triton.Config:
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    if _DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _times(x, inv):
    """``x * inv[:, None]`` rounded as torch rounds ``x * inv.to(x.dtype)``: both factors in x's dtype,
    the product in fp32, rounded once."""
    return (x.to(tl.float32) * inv.to(x.dtype).to(tl.float32)[:, None]).to(x.dtype)


@triton.jit
def _keep(token_key, threshold, feature_key):
    """``mix32(token_key ^ feature_key) >= threshold`` for a (rows, cols) tile: ``kernels.dropout``'s mask."""
    h = (token_key[:, None] ^ feature_key[None, :]).to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x21F0AAAD
    h = h ^ (h >> 15)
    h = h * 0x735A2D97
    h = h ^ (h >> 15)
    return h.to(tl.int64) >= threshold[:, None]


# The kernel is bound by memory: smaller tiles keep more programs (warps) resident per SM, bigger ones issue
# wider accesses; ptxas (benchmarks/triton_resources.py) puts the 64x128 tiles at ~190 registers and 64-98 KB
# of shared memory (2-3 programs per SM), 64x64 at ~100 registers and 32-48 KB (4-5). The last configuration
# is the small one the interpreter runs.
_TERM_CONFIGS = [
    _cfg(4, 3, BLOCK_K=64, BLOCK_N=64),  # the fastest at every Llama-3.2-1B shape forced alone on an H100
    _cfg(4, 2, BLOCK_K=64, BLOCK_N=64),
    _cfg(4, 3, BLOCK_K=128, BLOCK_N=128),
    _cfg(4, 4, BLOCK_K=64, BLOCK_N=128),
    _cfg(8, 3, BLOCK_K=64, BLOCK_N=128),
    _cfg(8, 3, BLOCK_K=128, BLOCK_N=256),
    _cfg(4, 2, BLOCK_K=32, BLOCK_N=32),
]


@_autotune(_TERM_CONFIGS, key=["K", "N", "BLOCK_R", "DROPOUT_IN", "DROPOUT_OUT"], fixed=0)
@triton.jit
def _lora_term_kernel(
    x_ptr, w1_ptr, w2_ptr, s_ptr, c_ptr, bias_ptr, scale_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr,
    tok_key_ptr, thr_ptr, inv_ptr, feat_in_ptr, feat_out_ptr,
    K, N, R,
    stride_xm, stride_xk, stride_1z, stride_1k, stride_1r, stride_2z, stride_2r, stride_2n,
    stride_sm, stride_sr, stride_cm, stride_cn,
    DROPOUT_IN: tl.constexpr, DROPOUT_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """For one (slot z, token block) of the schedule table and one share of the output columns::

        S = scale_z · (X̂ W1_z)             (BLOCK_M, R), stored by the first column share
        C = (S W2_z) ⊙ K_out (+ bias)       (BLOCK_M, N), the LoRA term the base GEMM then adds (beta = 1)

    Forward: X = x, W1 = A_z, W2 = B_z (S = S', C = S'B). Backward: X = dY, W1 = B_zᵀ, W2 = A_zᵀ (S = dS,
    C = (dS Aᵀ) ⊙ K). ``N == 0`` leaves only the shrink. Rows of slots with scale 0 get zeros (and the bias).
    The column shares of one block are neighbours in launch order, so all but the first read X from L2.
    """
    share = tl.program_id(0)
    pid = tl.program_id(1)
    z = tl.load(blk_slot_ptr + pid).to(tl.int64)
    start = tl.load(blk_start_ptr + pid)
    end = tl.load(blk_end_ptr + pid)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    scale = tl.load(scale_ptr + z, mask=z >= 0, other=0.0)  # slot -1: padding, whose term is zero
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if DROPOUT_IN or DROPOUT_OUT:
        tok_key = tl.load(tok_key_ptr + rows, mask=row_ok, other=0)
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0)
        inv = tl.load(inv_ptr + rows, mask=row_ok, other=0.0)
    if scale != 0.0:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if DROPOUT_IN:
                feat = tl.load(feat_in_ptr + ks, mask=k_ok, other=0)
                x = tl.where(_keep(tok_key, thr, feat), _times(x, inv), 0.0).to(x.dtype)
            w = tl.load(
                w1_ptr + z * stride_1z + ks[:, None] * stride_1k + ranks[None, :] * stride_1r,
                mask=k_ok[:, None] & rank_ok[None, :],
                other=0.0,
            )
            acc = _dot(x, w, acc, PRECISION)
        acc = acc * scale
    s = acc.to(s_ptr.dtype.element_ty)  # rounded once: what is saved is what the expand uses
    if share == 0:
        tl.store(s_ptr + rows[:, None] * stride_sm + ranks[None, :] * stride_sr, s,
                 mask=row_ok[:, None] & rank_ok[None, :])

    # This program's share of the output columns: whole BLOCK_N tiles, the shares as equal as they go.
    tiles = tl.cdiv(N, BLOCK_N)
    per_share = tl.cdiv(tiles, tl.num_programs(0))
    n_begin = share * per_share * BLOCK_N
    n_end = tl.minimum(N, n_begin + per_share * BLOCK_N)
    for n0 in range(n_begin, n_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_end
        out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if scale != 0.0:
            w = tl.load(
                w2_ptr + z * stride_2z + ranks[:, None] * stride_2r + cols[None, :] * stride_2n,
                mask=rank_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            out = _dot(s, w, out, PRECISION)
            if DROPOUT_OUT:
                feat = tl.load(feat_out_ptr + cols, mask=col_ok, other=0)
                out = tl.where(_keep(tok_key, thr, feat), out * inv[:, None], 0.0)
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, out.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _outer_kernel(
    u_ptr, v_ptr, g_ptr, part_ptr, scale_ptr, slot_blocks_ptr, blk_start_ptr, blk_end_ptr,
    tok_key_ptr, thr_ptr, inv_ptr, feat_ptr,
    DIM_I, DIM_J, Z,
    stride_um, stride_ui, stride_vm, stride_vj, stride_gz, stride_gi, stride_gj,
    HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """``G_z += Ûᵀ V`` over slot ``z``'s tokens for one (BLOCK_I, BLOCK_J) tile (Û: U with dropout on its
    columns). With ``SPLIT > 1``, program ``split`` takes every SPLIT-th token block and writes its partial sum
    to ``part[split, z]`` (fp32) for the host to add; otherwise it adds into G itself (one owner per tile)."""
    pid_zs = tl.program_id(0)
    z = pid_zs // SPLIT
    split = pid_zs % SPLIT
    ii = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    i_ok = ii < DIM_I
    j_ok = jj < DIM_J
    b0 = tl.load(slot_blocks_ptr + z)
    b1 = tl.load(slot_blocks_ptr + z + 1)
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    if HAS_DROPOUT:
        feat = tl.load(feat_ptr + ii, mask=i_ok, other=0)
    if tl.load(scale_ptr + z) != 0.0:
        for b in range(b0 + split, b1, SPLIT):
            rows = tl.load(blk_start_ptr + b) + tl.arange(0, BLOCK_M)
            row_ok = rows < tl.load(blk_end_ptr + b)
            u = tl.load(
                u_ptr + rows[:, None] * stride_um + ii[None, :] * stride_ui,
                mask=row_ok[:, None] & i_ok[None, :],
                other=0.0,
            )
            if HAS_DROPOUT:
                tok_key = tl.load(tok_key_ptr + rows, mask=row_ok, other=0)
                thr = tl.load(thr_ptr + rows, mask=row_ok, other=0)
                inv = tl.load(inv_ptr + rows, mask=row_ok, other=0.0)
                u = tl.where(_keep(tok_key, thr, feat), _times(u, inv), 0.0).to(u.dtype)
            v = tl.load(
                v_ptr + rows[:, None] * stride_vm + jj[None, :] * stride_vj,
                mask=row_ok[:, None] & j_ok[None, :],
                other=0.0,
            )
            acc = _dot(tl.trans(u), v, acc, PRECISION)
    mask = i_ok[:, None] & j_ok[None, :]
    if SPLIT == 1:
        g = g_ptr + z.to(tl.int64) * stride_gz + ii[:, None] * stride_gi + jj[None, :] * stride_gj
        total = tl.load(g, mask=mask, other=0.0).to(tl.float32) + acc
        tl.store(g, total.to(g_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + ((split * Z + z).to(tl.int64) * DIM_I + ii[:, None]) * DIM_J + jj[None, :]
        tl.store(part, acc, mask=mask)


@dataclass(frozen=True)
class StepTables:
    """One step's launch tables (device int32), built from ``SegmentMeta``'s host copy.

    Attributes:
        blk_slot / blk_start / blk_end: the schedule table: token blocks of at most ``BLOCK_TOKENS`` that
            never cross a segment, ordered by slot, then the blocks of ``meta.pad_spans`` under slot -1.
        slot_blocks: ``(Z + 1,)`` slot ``z`` owns blocks ``[slot_blocks[z], slot_blocks[z + 1])``.
        max_slot_blocks: the most blocks one slot has.
    """

    blk_slot: torch.Tensor
    blk_start: torch.Tensor
    blk_end: torch.Tensor
    slot_blocks: torch.Tensor
    num_blocks: int
    active_slots: int
    max_slot_blocks: int


def step_tables(meta: SegmentMeta) -> StepTables:
    """The tables for ``meta`` (built once per step: cached on the metadata, which every layer shares)."""
    cached = meta.cache.get("triton")
    if isinstance(cached, StepTables):
        return cached
    per_slot: list[list[tuple[int, int]]] = [[] for _ in range(meta.num_slots)]
    pad_blocks: list[tuple[int, int]] = []
    start = 0
    spans = iter(meta.pad_spans)
    span = next(spans, None)
    for z, n in zip(meta.slot_ids, meta.lengths, strict=True):
        end = start + n
        while start < end:  # cut the segment into runs of real tokens and runs of padding
            if span is not None and span[1] <= start:
                span = next(spans, None)
                continue
            padded = span is not None and span[0] <= start
            stop = min(end, span[1] if padded else span[0]) if span is not None else end
            owner = pad_blocks if padded else per_slot[z]
            owner.extend((b, min(b + BLOCK_TOKENS, stop)) for b in range(start, stop, BLOCK_TOKENS))
            start = stop
    # Padding blocks come last, under slot -1: the term kernel writes their rows' zeros, nothing else reads them.
    blocks = [(z, b, e) for z in range(meta.num_slots) for b, e in per_slot[z]] + [(-1, b, e) for b, e in pad_blocks]
    slot_blocks = [0]
    for owned in per_slot:
        slot_blocks.append(slot_blocks[-1] + len(owned))
    host = torch.tensor(
        [z for z, _, _ in blocks] + [b for _, b, _ in blocks] + [e for _, _, e in blocks]
        + slot_blocks,
        dtype=torch.int32,
    )  # fmt: skip
    device = meta.seg_slots.device
    flat = host.to(device, non_blocking=True) if device.type != "cpu" else host
    nb = len(blocks)
    blk_slot, blk_start, blk_end, slot_blocks_t = torch.split(flat, [nb, nb, nb, meta.num_slots + 1])
    tables = StepTables(
        blk_slot,
        blk_start,
        blk_end,
        slot_blocks_t,
        num_blocks=nb,
        active_slots=sum(1 for owned in per_slot if owned),
        max_slot_blocks=max((len(owned) for owned in per_slot), default=0),
    )
    meta.cache["triton"] = tables
    return tables


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel here fills (the tests swap in one poisoned with NaN: all of it must be written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_r(r_max: int) -> int:
    return max(16, triton.next_power_of_2(r_max))


def _dropout_args(dropout: LayerDropout | None, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if dropout is None:
        return (like, like, like, like)  # never read
    k = dropout.keys
    return (k.token_keys, k.threshold, k.inv_keep, dropout.feature_keys)


def lora_term(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_strides: tuple[int, int, int],
    w2: torch.Tensor,
    w2_strides: tuple[int, int, int],
    n_out: int,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    meta: SegmentMeta,
    dropout_in: LayerDropout | None,
    dropout_out: LayerDropout | None,
    r_max: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(S, C)`` of ``_lora_term_kernel``: S ``(tokens, r_max)``; C ``(tokens, n_out)``, or ``None`` when
    ``n_out == 0`` (the shrink alone). ``w1_strides`` are W1's (slot, k, rank) strides, ``w2_strides`` W2's
    (slot, rank, n) strides."""
    tables = step_tables(meta)
    tokens, k = x.shape
    s = _new_output((tokens, r_max), x.dtype, x.device)
    c = _new_output((tokens, n_out), x.dtype, x.device) if n_out else None
    if tables.num_blocks == 0:
        return s, c
    keys = _dropout_args(dropout_in or dropout_out, tables.blk_slot)
    feat_in = dropout_in.feature_keys if dropout_in is not None else tables.blk_slot
    feat_out = dropout_out.feature_keys if dropout_out is not None else tables.blk_slot
    # Few token blocks (a short step) would leave SMs idle: split each block's columns over several programs,
    # each recomputing the block's small shrink. Measured on an H100 (benchmarks/results/lora_term-*): more
    # shares than that cost more in repeated shrinks than they gain (8 per SM made the engine 4% slower).
    shares = max(1, min(triton.cdiv(n_out, 128), PROGRAMS_PER_SM * _num_sms(x.device) // tables.num_blocks))
    shares = shares if n_out else 1
    out = c if c is not None else s
    _lora_term_kernel[(shares, tables.num_blocks)](
        x, w1, w2, s, out, bias if bias is not None else s, scale, tables.blk_slot, tables.blk_start, tables.blk_end,
        *keys[:3], feat_in, feat_out,
        k, n_out, r_max,
        x.stride(0), x.stride(1), *w1_strides, *w2_strides, s.stride(0), s.stride(1), out.stride(0), out.stride(1),
        DROPOUT_IN=dropout_in is not None, DROPOUT_OUT=dropout_out is not None, HAS_BIAS=bias is not None,
        PRECISION=_precision(x.dtype), BLOCK_M=BLOCK_TOKENS, BLOCK_R=_block_r(r_max),
    )  # fmt: skip
    return s, c


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:  # asked per backward launch: keep the driver query out of the hot path
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def outer(
    u: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: torch.Tensor,
    meta: SegmentMeta,
    dropout: LayerDropout | None,
) -> None:
    """``G_z += Ûᵀ V`` over each slot's tokens, in place; G is ``(Z, I, J)`` (any strides: a store's view)."""
    tables = step_tables(meta)
    if tables.num_blocks == 0:
        return
    i_dim, j_dim = u.shape[1], v.shape[1]
    # Not autotuned: the kernel adds into G, which tuning runs would add into again. One of I, J is the rank.
    block_i, block_j = (min(128, max(16, triton.next_power_of_2(d))) for d in (i_dim, j_dim))
    # Few slots, long segments: split each slot's token blocks so the grid fills the GPU.
    tiles = tables.active_slots * triton.cdiv(i_dim, block_i) * triton.cdiv(j_dim, block_j)
    split = max(1, min(16, tables.max_slot_blocks // 4, 2 * _num_sms(u.device) // max(tiles, 1)))
    split = 1 << (split.bit_length() - 1)  # a power of two: few distinct compiled variants
    z = meta.num_slots
    part = _new_output((split, z, i_dim, j_dim), torch.float32, u.device) if split > 1 else g

    grid = (z * split, triton.cdiv(i_dim, block_i), triton.cdiv(j_dim, block_j))
    _outer_kernel[grid](
        u, v, g, part, scale, tables.slot_blocks, tables.blk_start, tables.blk_end,
        *_dropout_args(dropout, tables.blk_slot),
        i_dim, j_dim, z,
        u.stride(0), u.stride(1), v.stride(0), v.stride(1), *g.stride(),
        HAS_DROPOUT=dropout is not None, PRECISION=_precision(u.dtype), SPLIT=split, BLOCK_M=BLOCK_TOKENS,
        BLOCK_I=block_i, BLOCK_J=block_j, num_warps=8 if block_i * block_j >= 128 * 128 else 4, num_stages=3,
    )  # fmt: skip
    if split > 1:
        g.add_(part.sum(0).to(g.dtype))


class LoraLinearFunction(torch.autograd.Function):
    """The frozen linear layer plus the pack's LoRA path, forward and backward in Triton (see module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: torch.Tensor,
        meta: SegmentMeta,
        dropout: LayerDropout | None,
        grad_a: torch.Tensor | None,
        grad_b: torch.Tensor | None,
    ) -> torch.Tensor:
        r_max = lora_a.shape[2]
        a_strides = (lora_a.stride(0), lora_a.stride(1), lora_a.stride(2))
        b_strides = (lora_b.stride(0), lora_b.stride(1), lora_b.stride(2))
        # S' and C = S'B (+ bias) in one kernel, then cuBLAS adds X Wᵀ into C in its epilogue (beta = 1).
        s, y = lora_term(x, lora_a, a_strides, lora_b, b_strides, weight.shape[0], bias, scale, meta, dropout, None,
                         r_max)  # fmt: skip
        assert y is not None
        y.addmm_(x, weight.t())
        ctx.save_for_backward(x, weight, lora_a, lora_b, scale, s)
        ctx.meta, ctx.dropout, ctx.grad_a, ctx.grad_b = meta, dropout, grad_a, grad_b
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, lora_a, lora_b, scale, s = ctx.saved_tensors
        meta: SegmentMeta = ctx.meta
        dropout: LayerDropout | None = ctx.dropout
        dy = dy.contiguous()
        r_max = lora_a.shape[2]
        bt_strides = (lora_b.stride(0), lora_b.stride(2), lora_b.stride(1))  # B_zᵀ as (d_out, r)
        at_strides = (lora_a.stride(0), lora_a.stride(2), lora_a.stride(1))  # A_zᵀ as (r, d_in)
        # dS = scale · dY Bᵀ and C = (dS Aᵀ) ⊙ K in one kernel; cuBLAS adds dY W into C. Without an input
        # gradient (a first layer under a frozen embedding) the kernel computes dS alone.
        n_dx = weight.shape[1] if ctx.needs_input_grad[0] else 0
        ds, dx = lora_term(dy, lora_b, bt_strides, lora_a, at_strides, n_dx, None, scale, meta, None, dropout, r_max)
        if dx is not None:
            dx.addmm_(dy, weight)
        grad_b = ctx.grad_b if ctx.grad_b is not None else torch.zeros_like(lora_b)
        outer(s, dy, grad_b, scale, meta, None)  # dB += S'ᵀ dY
        grad_a = ctx.grad_a if ctx.grad_a is not None else torch.zeros_like(lora_a)
        outer(x, ds, grad_a, scale, meta, dropout)  # dA += X̂ᵀ dS
        return (
            dx,
            None,
            None,
            grad_a if ctx.grad_a is None else None,
            grad_b if ctx.grad_b is None else None,
            None,
            None,
            None,
            None,
            None,
        )
