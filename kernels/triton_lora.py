"""Triton kernels for a LoRA-wrapped linear layer of a pack: the frozen GEMM and every slot's adapter together.

Forward, for the tokens ``n`` of each segment of slot ``z`` (the contract of ``kernels.lora_delta``)::

    S'  = scale_z · (X̂ A_z)                    _shrink_kernel      one launch, all slots
    Y   = X Wᵀ + S' B_z  (+ bias)               _linear_kernel      the expand is added to the base GEMM's
                                                                    accumulator in registers: Y is written once
Backward, given dY::

    dS  = scale_z · (dY B_zᵀ)                   _shrink_kernel      (B read transposed through its strides)
    dB_z += S'ᵀ dY                              _outer_kernel       per (slot, tile), over the slot's tokens
    dA_z += X̂ᵀ dS                               _outer_kernel       dropout recomputed from the keys
    dX  = dY W + (dS A_zᵀ) ⊙ K                  _linear_kernel      LoRA term in the base GEMM's epilogue

Work is driven by tables built once per step from the host copy of ``SegmentMeta`` and cached on it: the
shrink and outer kernels walk (slot, token block) pairs whose blocks never cross a segment; the GEMM's token
tiles do cross segments (no token padding) and find their segments by binary search over the segment
bounds. Padded ranks cost only the width of one MMA; slots with scale 0 are skipped. Accumulation is fp32;
fp16 and bf16 inputs use the tensor cores, fp32 inputs IEEE fp32 dots (so fp32 results stay near 1e-6).
Tile shapes of the shrink and the GEMM are autotuned per GPU and shape bucket (cached on disk where Triton
supports it; the outer kernel, which adds into the gradient store, takes its tiles from the shape); with
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors with one small configuration each.
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
BLOCK_TOKENS = 64  # token block of the shrink and outer kernels' schedule table
_LOG2_SEGMENTS = 16  # binary-search steps over segment bounds: up to 65535 segments per step
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


# The last configuration of each list is the small one the interpreter runs.
# Checked offline with ptxas (sm_90a): none of these spills without dropout; with dropout (a second
# accumulator) 128x256 and 4-warp 128x128 do, and the tuner passes them over.
_LINEAR_CONFIGS = [
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64),
    _cfg(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64),
    _cfg(8, 3, BLOCK_M=256, BLOCK_N=128, BLOCK_K=64),
    _cfg(8, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64),
    _cfg(4, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64),
    _cfg(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64),
    _cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64),
    _cfg(4, 2, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32),
]
_SHRINK_CONFIGS = [
    _cfg(4, 4, BLOCK_K=128),
    _cfg(4, 3, BLOCK_K=64),
    _cfg(8, 3, BLOCK_K=128),
    _cfg(4, 2, BLOCK_K=32),
]


def _prune_by_size(configs: list[triton.Config], named_args: dict[str, Any], **_: Any) -> list[triton.Config]:
    """Drop column tiles far wider than the problem (they only waste the autotuner's time)."""

    def fits(config: triton.Config) -> bool:
        return config.kwargs.get("BLOCK_N", 0) <= max(32, triton.next_power_of_2(named_args["N"]))

    return [c for c in configs if fits(c)] or configs[-1:]


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


@_autotune(_SHRINK_CONFIGS, key=["K", "BLOCK_R", "HAS_DROPOUT"], fixed=0)
@triton.jit
def _shrink_kernel(
    x_ptr, w_ptr, out_ptr, scale_ptr, blk_slot_ptr, blk_start_ptr, blk_end_ptr,
    tok_key_ptr, thr_ptr, inv_ptr, feat_ptr,
    K, R,
    stride_xm, stride_xk, stride_wz, stride_wk, stride_wr, stride_om, stride_or,
    HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[rows] = scale_z · (X̂[rows] @ W_z)`` for one (slot, token block) of the schedule table."""
    pid = tl.program_id(0)
    z = tl.load(blk_slot_ptr + pid).to(tl.int64)
    start = tl.load(blk_start_ptr + pid)
    end = tl.load(blk_end_ptr + pid)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.arange(0, BLOCK_R)
    col_ok = cols < R
    scale = tl.load(scale_ptr + z)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if scale != 0.0:
        if HAS_DROPOUT:
            tok_key = tl.load(tok_key_ptr + rows, mask=row_ok, other=0)
            thr = tl.load(thr_ptr + rows, mask=row_ok, other=0)
            inv = tl.load(inv_ptr + rows, mask=row_ok, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if HAS_DROPOUT:
                feat = tl.load(feat_ptr + ks, mask=k_ok, other=0)
                kept = _keep(tok_key, thr, feat)
                x = tl.where(kept, _times(x, inv), 0.0).to(x.dtype)
            w = tl.load(
                w_ptr + z * stride_wz + ks[:, None] * stride_wk + cols[None, :] * stride_wr,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc = _dot(x, w, acc, PRECISION)
        acc = acc * scale
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_or
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _find_segment(bounds_ptr, num_segments, row, LOG2_SEGMENTS: tl.constexpr):
    """The segment holding token ``row``: the largest ``s < num_segments`` with ``bounds[s] <= row``."""
    lo = tl.full((), 0, tl.int32)  # tensors from the start: loop-carried values must keep one type
    hi = tl.full((), 0, tl.int32) + num_segments
    for _ in range(LOG2_SEGMENTS):
        mid = (lo + hi) // 2
        go_right = (hi - lo > 1) & (tl.load(bounds_ptr + mid) <= row)
        lo = tl.where(go_right, mid, lo)
        hi = tl.where((hi - lo > 1) & ~go_right, mid, hi)
    return lo


@_autotune(_LINEAR_CONFIGS, key=["M_BUCKET", "N", "K", "BLOCK_R", "HAS_DROPOUT"], fixed=3, prune_configs_by={
    "early_config_prune": _prune_by_size})
@triton.jit
def _linear_kernel(
    p_ptr, q_ptr, out_ptr, bias_ptr, l_ptr, r_ptr, scale_ptr, seg_slot_ptr, seg_bounds_ptr,
    tok_key_ptr, thr_ptr, inv_ptr, feat_ptr,
    M, N, K, R, num_segments, M_BUCKET,
    stride_pm, stride_pk, stride_qk, stride_qn, stride_om, stride_on,
    stride_lm, stride_lr, stride_rz, stride_rr, stride_rn,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, LOG2_SEGMENTS: tl.constexpr,
    N_MULTIPLE_OF_8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``out = P @ Q (+ bias) + (Σ_segments L_seg @ R_z) (⊙ K)`` for one (BLOCK_M, BLOCK_N) tile.

    Forward: P = X, Q = Wᵀ, L = S', R_z = B_z. Backward: P = dY, Q = W, L = dS, R_z = A_zᵀ, K the dropout
    multipliers of the output columns (the layer's input features).
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order: GROUP_M token tiles share each column of Q while it is in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    # Clamped indices keep every load of the main loop in bounds without a mask on M and N. The hint gives
    # back what the clamp hides from the compiler, that columns run in contiguous runs: without it, loads of
    # W along d_in (the backward) and every store are 2-byte accesses (4x slower layers, seen on an H100).
    # It holds when N is a multiple of 8 (a run never straddles the clamp); other N go without it.
    rows_c = tl.where(row_ok, rows, 0).to(tl.int64)
    cols_c = tl.where(col_ok, cols, 0)
    if N_MULTIPLE_OF_8:
        cols_c = tl.max_contiguous(tl.multiple_of(cols_c, BLOCK_N), BLOCK_N)
    cols_c = cols_c.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        p = tl.load(p_ptr + rows_c[:, None] * stride_pm + ks[None, :] * stride_pk, mask=k_ok[None, :], other=0.0)
        q = tl.load(q_ptr + ks[:, None] * stride_qk + cols_c[None, :] * stride_qn, mask=k_ok[:, None], other=0.0)
        acc = _dot(p, q, acc, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_c).to(tl.float32)[None, :]

    # The LoRA term of every segment that meets this token tile, masked to its rows.
    first_row = pid_m * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, M) - 1
    seg_lo = _find_segment(seg_bounds_ptr, num_segments, first_row, LOG2_SEGMENTS)
    seg_hi = _find_segment(seg_bounds_ptr, num_segments, last_row, LOG2_SEGMENTS) + 1
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    # Without dropout the LoRA products go straight into the GEMM's accumulator: a second (BLOCK_M, BLOCK_N)
    # fp32 accumulator would double the registers (255 and spilling at 128x256, wgmma serialised).
    if HAS_DROPOUT:
        lora = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        lora = acc
    for s in range(seg_lo, seg_hi):
        z = tl.load(seg_slot_ptr + s).to(tl.int64)
        if tl.load(scale_ptr + z) != 0.0:
            in_seg = (rows >= tl.load(seg_bounds_ptr + s)) & (rows < tl.load(seg_bounds_ptr + s + 1))
            lo = tl.load(
                l_ptr + rows_c[:, None] * stride_lm + ranks[None, :] * stride_lr,
                mask=in_seg[:, None] & rank_ok[None, :],
                other=0.0,
            )
            rz = tl.load(
                r_ptr + z * stride_rz + ranks[:, None] * stride_rr + cols_c[None, :] * stride_rn,
                mask=rank_ok[:, None],
                other=0.0,
            )
            lora = _dot(lo, rz, lora, PRECISION)
    if HAS_DROPOUT:
        tok_key = tl.load(tok_key_ptr + rows_c)
        thr = tl.load(thr_ptr + rows_c)
        inv = tl.load(inv_ptr + rows_c)
        feat = tl.load(feat_ptr + cols_c)
        acc += tl.where(_keep(tok_key, thr, feat), lora * inv[:, None], 0.0)
    else:
        acc = lora
    out = out_ptr + rows_c[:, None] * stride_om + cols_c[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


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
            never cross a segment, ordered by slot.
        slot_blocks: ``(Z + 1,)`` slot ``z`` owns blocks ``[slot_blocks[z], slot_blocks[z + 1])``.
        seg_slot / seg_bounds: each segment's slot, and the ``S + 1`` segment bounds (token offsets).
        max_slot_blocks: the most blocks one slot has.
    """

    blk_slot: torch.Tensor
    blk_start: torch.Tensor
    blk_end: torch.Tensor
    slot_blocks: torch.Tensor
    seg_slot: torch.Tensor
    seg_bounds: torch.Tensor
    num_blocks: int
    active_slots: int
    max_slot_blocks: int


def step_tables(meta: SegmentMeta) -> StepTables:
    """The tables for ``meta`` (built once per step: cached on the metadata, which every layer shares)."""
    cached = meta.cache.get("triton")
    if isinstance(cached, StepTables):
        return cached
    starts, bounds = [], [0]
    for n in meta.lengths:
        starts.append(bounds[-1])
        bounds.append(bounds[-1] + n)
    per_slot: list[list[tuple[int, int]]] = [[] for _ in range(meta.num_slots)]
    for z, start, n in zip(meta.slot_ids, starts, meta.lengths, strict=True):
        per_slot[z].extend((b, min(b + BLOCK_TOKENS, start + n)) for b in range(start, start + n, BLOCK_TOKENS))
    blocks = [(z, b, e) for z in range(meta.num_slots) for b, e in per_slot[z]]
    slot_blocks = [0]
    for owned in per_slot:
        slot_blocks.append(slot_blocks[-1] + len(owned))
    host = torch.tensor(
        [z for z, _, _ in blocks] + [b for _, b, _ in blocks] + [e for _, _, e in blocks]
        + slot_blocks + list(meta.slot_ids) + bounds,
        dtype=torch.int32,
    )  # fmt: skip
    device = meta.seg_slots.device
    flat = host.to(device, non_blocking=True) if device.type != "cpu" else host
    nb, z, s = len(blocks), meta.num_slots, meta.num_segments
    sizes = [nb, nb, nb, z + 1, s, s + 1]
    blk_slot, blk_start, blk_end, slot_blocks_t, seg_slot, seg_bounds = torch.split(flat, sizes)
    tables = StepTables(
        blk_slot,
        blk_start,
        blk_end,
        slot_blocks_t,
        seg_slot,
        seg_bounds,
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


def shrink(
    x: torch.Tensor,
    w: torch.Tensor,
    w_strides: tuple[int, int, int],
    scale: torch.Tensor,
    meta: SegmentMeta,
    dropout: LayerDropout | None,
    r_max: int,
) -> torch.Tensor:
    """``(tokens, r_max)``: ``scale_z · (X̂ W_z)`` per segment; ``W_z`` is ``(K, r_max)`` read through
    ``w_strides`` = (slot, k, rank) strides. Rows of slots with scale 0 are zeros."""
    tables = step_tables(meta)
    out = _new_output((x.shape[0], r_max), x.dtype, x.device)
    if tables.num_blocks == 0:
        return out
    _shrink_kernel[(tables.num_blocks,)](
        x, w, out, scale, tables.blk_slot, tables.blk_start, tables.blk_end, *_dropout_args(dropout, tables.blk_slot),
        x.shape[1], r_max,
        x.stride(0), x.stride(1), *w_strides, out.stride(0), out.stride(1),
        HAS_DROPOUT=dropout is not None, PRECISION=_precision(x.dtype),
        BLOCK_M=BLOCK_TOKENS, BLOCK_R=_block_r(r_max),
    )  # fmt: skip
    return out


def linear(
    p: torch.Tensor,
    q: torch.Tensor,
    q_strides: tuple[int, int],
    n_out: int,
    bias: torch.Tensor | None,
    lora_l: torch.Tensor,
    lora_r: torch.Tensor,
    r_strides: tuple[int, int, int],
    scale: torch.Tensor,
    meta: SegmentMeta,
    dropout: LayerDropout | None,
) -> torch.Tensor:
    """``(tokens, n_out)``: ``P Q (+ bias) + (L R_z)(⊙ K)`` in one GEMM (see ``_linear_kernel``).

    ``q_strides`` are Q's (k, n) strides; ``r_strides`` R's (slot, rank, n) strides.
    """
    tables = step_tables(meta)
    m, k = p.shape
    r_max = lora_l.shape[1]
    out = _new_output((m, n_out), p.dtype, p.device)
    if m == 0:
        return out

    def grid(cfg: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n_out, cfg["BLOCK_N"]),)

    _linear_kernel[grid](
        p, q, out, bias if bias is not None else out, lora_l, lora_r, scale, tables.seg_slot, tables.seg_bounds,
        *_dropout_args(dropout, tables.seg_slot),
        m, n_out, k, r_max, meta.num_segments, triton.next_power_of_2(m),
        p.stride(0), p.stride(1), *q_strides, out.stride(0), out.stride(1),
        lora_l.stride(0), lora_l.stride(1), *r_strides,
        HAS_BIAS=bias is not None, HAS_DROPOUT=dropout is not None, PRECISION=_precision(p.dtype),
        LOG2_SEGMENTS=_LOG2_SEGMENTS, N_MULTIPLE_OF_8=n_out % 8 == 0, BLOCK_R=_block_r(r_max), GROUP_M=8,
    )  # fmt: skip
    return out


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
        s = shrink(x, lora_a, a_strides, scale, meta, dropout, r_max)  # S' = scale · X̂ A
        b_strides = (lora_b.stride(0), lora_b.stride(1), lora_b.stride(2))
        w_t = (weight.stride(1), weight.stride(0))  # Wᵀ as (d_in, d_out)
        y = linear(x, weight, w_t, weight.shape[0], bias, s, lora_b, b_strides, scale, meta, dropout=None)
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
        # dS = scale · dY Bᵀ: the shrink kernel reading B_z as (d_out, r) through its strides.
        bt_strides = (lora_b.stride(0), lora_b.stride(2), lora_b.stride(1))
        ds = shrink(dy, lora_b, bt_strides, scale, meta, None, r_max)
        grad_b = ctx.grad_b if ctx.grad_b is not None else torch.zeros_like(lora_b)
        outer(s, dy, grad_b, scale, meta, None)
        grad_a = ctx.grad_a if ctx.grad_a is not None else torch.zeros_like(lora_a)
        outer(x, ds, grad_a, scale, meta, dropout)
        dx = None
        if ctx.needs_input_grad[0]:
            at_strides = (lora_a.stride(0), lora_a.stride(2), lora_a.stride(1))  # A_zᵀ as (r, d_in)
            w = (weight.stride(0), weight.stride(1))  # W as (d_out, d_in)
            dx = linear(dy, weight, w, weight.shape[1], None, ds, lora_a, at_strides, scale, meta, dropout)
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
