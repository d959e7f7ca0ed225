"""The memory-bound pieces of the Triton LoRA path, one by one, at the engine's shapes (issue 4 tuning).

    python -m benchmarks.lora_term          # on a GPU

For 32 slots of ranks 16/32/64 (r_max 64, adapters laid out rank-major as in the store), 16384 tokens in ragged
segments and the projections of Llama-3.2-1B, times (median of ``triton.testing.do_bench``) and effective
bandwidth (bytes the piece must move: its input activations read once, its output written once) of:

- term: ``kernels.triton_lora.lora_term`` as the layer calls it (forward: X, A, B; backward: dY, Bᵀ, Aᵀ), with
  the expand fused after the shrink in one kernel (autotuned), then every configuration of that kernel forced;
- shrink: the same kernel with no output columns (what a layer without an input gradient runs);
- AdamW over a store of the same pack (32 slots of Llama-3.2-1B's seven projections): the Triton kernel up to
  each slot's live columns, the same over whole rows, and the torch.compile'd eager update it replaced.

Writes benchmarks/results/lora_term-<device>-<date>.json.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.testing

import kernels.triton_lora as T
from benchmarks.common import write_result
from kernels import build_segments

TOKENS, SLOTS, RANKS, R_MAX = 16384, 32, (16, 32, 64), 64
SHAPES = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]


def bench(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def stacked(z: int, d_in: int, d_out: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A (Z, d_in, r) and B (Z, r, d_out) as strided views of one rank-major row per slot, like the store."""
    width = d_in + d_out
    flat = (torch.randn(z, R_MAX * width, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    a = flat.as_strided((z, d_in, R_MAX), (R_MAX * width, 1, width))
    b = flat.as_strided((z, R_MAX, d_out), (R_MAX * width, width, 1), d_in)
    return a, b


def term_rows(gen: torch.Generator) -> list[list[Any]]:
    weights = 0.5 + torch.rand(SLOTS, generator=gen)
    lengths = (weights / weights.sum() * TOKENS).floor().long()
    lengths[0] += TOKENS - int(lengths.sum())
    meta = build_segments(list(range(SLOTS)), lengths.tolist(), num_slots=SLOTS, device=torch.device("cuda"))
    scale = torch.full((SLOTS,), 2.0, device="cuda")
    tables = T.step_tables(meta)
    rows = []
    for d_in, d_out in SHAPES:
        a, b = stacked(SLOTS, d_in, d_out, gen)
        for direction in ("forward", "backward"):
            if direction == "forward":
                k, n = d_in, d_out
                w1, s1 = a, (a.stride(0), a.stride(1), a.stride(2))
                w2, s2 = b, (b.stride(0), b.stride(1), b.stride(2))
            else:
                k, n = d_out, d_in
                w1, s1 = b, (b.stride(0), b.stride(2), b.stride(1))
                w2, s2 = a, (a.stride(0), a.stride(2), a.stride(1))
            x = torch.randn(TOKENS, k, generator=gen).to("cuda", torch.bfloat16)
            gb = (TOKENS * k + TOKENS * n + TOKENS * R_MAX) * 2 / 1e9

            def term(x: torch.Tensor = x, n: int = n, w1: Any = w1, s1: Any = s1, w2: Any = w2, s2: Any = s2) -> None:
                T.lora_term(x, w1, s1, w2, s2, n, None, scale, meta, None, None, R_MAX)

            fused = bench(term)
            shrink = bench(lambda: term(n=0))
            forced = []
            for config in T._TERM_CONFIGS[:-1]:
                s_out = torch.empty(TOKENS, R_MAX, device="cuda", dtype=torch.bfloat16)
                c_out = torch.empty(TOKENS, n, device="cuda", dtype=torch.bfloat16)

                def one(config: Any = config, x: torch.Tensor = x, k: int = k, n: int = n, w1: Any = w1, s1: Any = s1,
                        w2: Any = w2, s2: Any = s2, s_out: torch.Tensor = s_out, c_out: torch.Tensor = c_out) -> None:
                    T._lora_term_kernel.fn[(1, tables.num_blocks)](
                        x, w1, w2, s_out, c_out, s_out, scale, tables.blk_slot, tables.blk_start, tables.blk_end,
                        tables.blk_slot, tables.blk_slot, tables.blk_slot, tables.blk_slot, tables.blk_slot,
                        k, n, R_MAX, x.stride(0), x.stride(1), *s1, *s2, R_MAX, 1, n, 1,
                        DROPOUT_IN=False, DROPOUT_OUT=False, HAS_BIAS=False, PRECISION="tf32",
                        BLOCK_M=T.BLOCK_TOKENS, BLOCK_R=R_MAX, num_warps=config.num_warps,
                        num_stages=config.num_stages, **config.kwargs)  # fmt: skip

                forced.append(round(bench(one), 4))
            rows.append([f"{d_in}x{d_out}", direction, round(fused, 4), round(gb / fused * 1e3, 0), round(shrink, 4),
                         round((TOKENS * k + TOKENS * R_MAX) * 2 / 1e9 / shrink * 1e3, 0), *forced])  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def adamw_rows() -> list[list[Any]]:
    from kernels.slot_adamw import slot_adamw_
    from worker.engine.optim import _adamw_update

    width = sum(d_in + d_out for d_in, d_out in
                [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192), (8192, 2048)]) * 16
    p = R_MAX * width
    params = torch.randn(SLOTS, p, device="cuda") * 0.02
    m, v = torch.zeros_like(params), torch.zeros_like(params)
    grads = (torch.randn(SLOTS, p, device="cuda") * 1e-3).to(torch.bfloat16)
    compute = params.to(torch.bfloat16)
    table = torch.tensor([[1.0], [1.0], [0.1], [0.999], [0.001], [0.03], [1e-8], [-1e-4]], device="cuda").expand(
        8, SLOTS).contiguous()
    live = torch.tensor([RANKS[i % 3] * width for i in range(SLOTS)], dtype=torch.int32, device="cuda")
    full = torch.full((SLOTS,), p, dtype=torch.int32, device="cuda")
    live_frac = float(live.sum()) / (SLOTS * p)
    gb = SLOTS * p * 28 / 1e9
    compiled = torch.compile(_adamw_update, dynamic=False)
    cols = table[:, :, None]
    rows = []
    t_live = bench(lambda: slot_adamw_(params, m, v, grads, compute, live, table, live_multiple_of_16=True))
    t_full = bench(lambda: slot_adamw_(params, m, v, grads, compute, full, table, live_multiple_of_16=True))
    t_comp = bench(lambda: compiled(params, m, v, grads, compute, *cols))
    rows.append(["triton, live columns", round(t_live, 3), round(gb * live_frac / t_live * 1e3, 0)])
    rows.append(["triton, whole rows", round(t_full, 3), round(gb / t_full * 1e3, 0)])
    rows.append(["torch.compile, whole rows", round(t_comp, 3), round(gb / t_comp * 1e3, 0)])
    for r in rows:
        print(r, flush=True)
    return rows


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = term_rows(gen)
    configs = [f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']} w{c.num_warps} s{c.num_stages}"
               for c in T._TERM_CONFIGS[:-1]]
    optimizer = adamw_rows()
    write_result(
        "lora_term",
        ["shape", "direction", "term ms", "term GB/s", "shrink ms", "shrink GB/s",
         *[f"forced {c} ms" for c in configs]],
        rows,
        {"tokens": TOKENS, "slots": SLOTS, "ranks": list(RANKS), "r_max": R_MAX,
         "bytes": "activations in + LoRA term out + S out, bf16 (weights from L2 not counted)",
         "adamw": {"headers": ["update", "ms", "GB/s (28 B per live element)"], "rows": optimizer,
                   "store": "32 slots x Llama-3.2-1B's seven projections, rank-major rows, ranks 16/32/64"}},
    )  # fmt: skip


if __name__ == "__main__":
    main()
