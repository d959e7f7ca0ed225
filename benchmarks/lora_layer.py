"""One LoRA-wrapped linear layer of a pack, forward + backward: what the LoRA path adds to the frozen GEMMs.

    python -m benchmarks.lora_layer                      # on a GPU; the full grid of issue 4
    python -m benchmarks.lora_layer --quick              # one shape, for a smoke run

For each layer shape (d_in x d_out), K slots with ranks 16/32/64 in turn (r_max 64) and a total token count
split raggedly among the slots (each slot 50-150% of the mean), times with CUDA events (median of
``triton.testing.do_bench``) of:

- base:     ``y = x Wᵀ`` and its input gradient ``dY W`` (W frozen: no weight gradient);
- triton:   ``kernels.lora_linear`` on the Triton backend (the LoRA term in one kernel, added by cuBLAS);
- grouped:  ``F.linear`` + ``kernels.lora_delta``, the torch backend (``torch._grouped_mm`` / ``bmm``);
- loop:     ``F.linear`` + a Python loop over slots (PEFT-style: two small matmuls per slot).

"+%" columns are (method − base) / base. The "graph:" columns time the same forward + backward captured in
a CUDA graph: what the device spends, without the host's launch overhead (eager timings of small layers
measure the host). Every row also checks the Triton output and gradients against the
torch backend (relative error, bf16). Writes benchmarks/results/lora_layer-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import write_result
from kernels import build_segments, lora_delta, lora_linear, set_backend

SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048), (4096, 14336)]
SLOTS = [1, 4, 8, 32]
TOKENS = [256, 1024, 4096, 8192]
RANKS = (16, 32, 64)


def ragged_lengths(total: int, k: int, gen: torch.Generator) -> list[int]:
    weights = 0.5 + torch.rand(k, generator=gen)
    lengths = (weights / weights.sum() * total).floor().long()
    lengths[0] += total - int(lengths.sum())
    return [int(n) for n in lengths]


def bench(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph(fn: Callable[[], Any], clear: Callable[[], None]) -> float | str:
    """Median ms of replaying ``fn`` (forward + backward) captured in a CUDA graph: the device's own time,
    without the host's launch overhead (which the eager timing includes where the host is the slower side).
    ``clear`` drops accumulated ``.grad`` tensors so that the capture allocates them in the graph's pool."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            clear()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # something in fn cannot be captured: say so in the table
        print(f"capture failed: {exc}", flush=True)
        return "-"
    return bench(graph.replay)


class LayerCase:
    """One case's inputs: ``k`` slots' adapters (ranks 16/32/64 in turn, zero beyond their rank up to r_max) on a
    frozen ``d_out x d_in`` weight, ``tokens`` split raggedly among the slots; and each method's forward +
    backward on them."""

    def __init__(self, d_in: int, d_out: int, k: int, tokens: int, device: torch.device, gen: torch.Generator) -> None:
        dtype = torch.bfloat16
        r_max = max(RANKS)
        self.lengths = ragged_lengths(tokens, k, gen)
        self.meta = build_segments(list(range(k)), self.lengths, num_slots=k, device=device)
        self.x = torch.randn(tokens, d_in, generator=gen).to(device, dtype).requires_grad_()
        self.weight = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(device, dtype)
        a = (torch.randn(k, d_in, r_max, generator=gen) / d_in**0.5).to(device, dtype)
        b = (torch.randn(k, r_max, d_out, generator=gen) / r_max**0.5).to(device, dtype)
        for z in range(k):
            rank = RANKS[z % len(RANKS)]
            a[z, :, rank:] = 0
            b[z, rank:, :] = 0
        self.a = a.requires_grad_()
        self.b = b.requires_grad_()
        self.scale = torch.tensor([2.0] * k, device=device)
        self.grad_a, self.grad_b = torch.zeros_like(a), torch.zeros_like(b)
        self.dy = torch.randn(tokens, d_out, generator=gen).to(device, dtype)

    def base(self) -> None:
        F.linear(self.x, self.weight).backward(self.dy)

    def backend(self, name: str) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            set_backend(name)  # type: ignore[arg-type]
            y = lora_linear(self.x, self.weight, None, self.a, self.b, self.scale, self.meta, None, self.grad_a,
                            self.grad_b)  # fmt: skip
            y.backward(self.dy)
            return y

        return step

    def grouped(self) -> None:
        x = self.x
        y = lora_delta(x, self.a, self.b, self.scale, self.meta, None, F.linear(x, self.weight), self.grad_a,
                       self.grad_b)  # fmt: skip
        y.backward(self.dy)

    def loop(self) -> None:
        x, a, b, scale = self.x, self.a, self.b, self.scale
        base_y = F.linear(x, self.weight)
        parts, start = [], 0
        for z, n in enumerate(self.lengths):
            parts.append(((x[start : start + n] @ a[z]) * scale[z]) @ b[z])
            start += n
        (base_y + torch.cat(parts)).backward(self.dy)
        a.grad = b.grad = None

    def clear(self) -> None:
        self.x.grad = self.a.grad = self.b.grad = None


def triton_errors(case: LayerCase) -> list[float]:
    """Relative errors of the Triton backend's output and gradients (x, a, b) against the torch backend's."""
    errs = []
    outs: dict[str, tuple[torch.Tensor, ...]] = {}
    for name in ("torch", "triton"):
        case.x.grad = None
        case.grad_a.zero_()
        case.grad_b.zero_()
        y = case.backend(name)()
        assert case.x.grad is not None
        outs[name] = (y.detach().float(), case.x.grad.detach().float(), case.grad_a.float(), case.grad_b.float())
    for got, want in zip(outs["triton"], outs["torch"], strict=True):
        errs.append(float((got - want).norm() / want.norm().clamp_min(1e-30)))
    set_backend("auto")
    return errs


def run_case(d_in: int, d_out: int, k: int, tokens: int, device: torch.device, gen: torch.Generator) -> list[Any]:
    case = LayerCase(d_in, d_out, k, tokens, device, gen)
    # Correctness first: Triton against the torch backend on the same inputs.
    errs = triton_errors(case)

    t_base = bench(case.base)
    t_triton = bench(case.backend("triton"))
    t_grouped = bench(case.grouped)
    t_loop = bench(case.loop)
    set_backend("auto")

    g_base = bench_graph(case.base, case.clear)
    g_triton = bench_graph(case.backend("triton"), case.clear)
    g_grouped = bench_graph(case.grouped, case.clear)
    set_backend("auto")

    return [f"{d_in}x{d_out}", k, tokens, _ms(t_base), _ms(t_triton), _ms(t_grouped), _ms(t_loop),
            _over(t_triton, t_base), _over(t_grouped, t_base), _over(t_loop, t_base),
            _ms(g_base), _ms(g_triton), _ms(g_grouped), _over(g_triton, g_base), _over(g_grouped, g_base),
            f"{max(errs):.1e}"]  # fmt: skip


def _over(t: float | str, base_ms: float | str) -> float | str:
    if isinstance(t, str) or isinstance(base_ms, str):
        return "-"
    return round(100 * (t - base_ms) / base_ms, 1)


def _ms(t: float | str) -> float | str:
    return round(t, 4) if isinstance(t, float) else t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one shape, K 8 and 32, 4096 tokens")
    parser.add_argument("--slots", type=int, nargs="+", default=SLOTS)
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    shapes, slots, tokens = (SHAPES[:1], [8, 32], [4096]) if args.quick else (SHAPES, args.slots, args.tokens)
    rows = []
    for d_in, d_out in shapes:
        for k in slots:
            for n in tokens:
                rows.append(run_case(d_in, d_out, k, n, device, gen))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    headers = ["d_in x d_out", "K", "tokens", "base ms", "triton ms", "grouped ms", "loop ms", "triton +%",
               "grouped +%", "loop +%", "graph: base ms", "graph: triton ms", "graph: grouped ms",
               "graph: triton +%", "graph: grouped +%", "max rel err triton vs torch"]  # fmt: skip
    write_result(
        "lora_layer" + ("-quick" if args.quick else ""),
        headers,
        rows,
        {"dtype": "bfloat16", "ranks": list(RANKS), "r_max": max(RANKS),
         "timing": "median of triton.testing.do_bench(warmup=25 ms, rep=100 ms), forward + backward; "
                   "'graph:' columns time replays of the same forward + backward captured in a CUDA graph "
                   "(device time without host launch overhead)",
         "base": "y = x W^T forward and dX = dY W backward (the frozen weight gets no gradient)"},
    )  # fmt: skip


if __name__ == "__main__":
    main()
