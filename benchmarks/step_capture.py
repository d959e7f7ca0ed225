"""What capturing the training step in a CUDA graph would buy (issue 15; design in docs/step-capture.md).

Builds the same pack as ``benchmarks.engine_throughput`` (random weights in a real architecture's shape, ranks
16/32/64 in thirds, all seven projections), draws one packed batch and times, on that same batch:

- ``eager``: the engine's step as it runs today (zero the gradients, forward, backward, the slot AdamW update);
- ``captured``: the same forward and backward captured once in a CUDA graph and replayed, then the same
  AdamW update (one kernel, launched eagerly).

Replaying one fixed batch is the ceiling of the design: a real step must also copy its batch into the graph's
static buffers and pad it to a captured bucket. Before timing, the benchmark checks that a replay produces the
same gradients as the eager step on the same weights (so the capture is of the real work), and it reports the
GPU time of the step (the replay's, synchronised), the eager step's wall time and their ratio: the GPU-busy
fraction the eager step reaches.

    python -m benchmarks.step_capture --shape smollm2-135m --trials 24 --batch 4 --seq-len 96   # on a GPU
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.base_models import SHAPES, load, make_rows, materialise, projections
from benchmarks.common import write_result
from benchmarks.engine_throughput import engine_steps, trial_specs
from kernels import set_backend
from worker.engine import feed


def timed_ms(body: Callable[[], None], warmup: int, steps: int) -> float:
    """Milliseconds a call of ``body``, synchronised before and after the timed calls."""
    for _ in range(warmup):
        body()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        body()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / steps


def measure(args: argparse.Namespace, backend: str, base: Path, tokenizer: Any) -> list[Any]:
    """One table row: the eager and the captured step of one pack on one fixed batch."""
    device = torch.device("cuda")
    set_backend(backend)  # type: ignore[arg-type]
    rows = make_rows(512, args.seq_len, seed=0)
    model = load(base, device)
    specs = trial_specs(args.trials, args.batch, args.seq_len, rows, 0.0, projections(args.shape))
    _, engine = engine_steps(model, tokenizer, specs, device, recompute=False)
    try:
        parts, _ = feed.draw(engine.slots, engine._fail)
        batch = engine.passes.pack(parts)
        stepped = [p.slot for p in parts]
        lrs = {slot: engine.state(slot).lr() for slot in stepped}
        live = {slot: engine.store.live_columns(slot) for slot in stepped}
        store, optimizer = engine.store, engine.optimizer

        def forward_backward() -> None:
            store.grads.zero_()
            engine.passes.forward_backward(batch)

        def eager() -> None:
            forward_backward()
            optimizer.step(lrs, live)

        eager_ms = timed_ms(eager, args.warmup, args.steps)

        # Capture: warm up on a side stream (the allocator and autotuners settle), then record one step.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward_backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward_backward()

        # The replay computes what the eager step computes, on the same weights.
        weights = store.weights.clone()
        forward_backward()
        expected = store.grads.float().clone()
        store.weights.copy_(weights)
        graph.replay()
        torch.cuda.synchronize()
        error = (store.grads.float() - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)

        def captured() -> None:
            graph.replay()
            optimizer.step(lrs, live)

        captured_ms = timed_ms(captured, args.warmup, args.steps)
        tokens = sum(len(e.input_ids) for p in parts for e in p.examples)
        return [args.shape, args.trials, args.batch, backend, tokens, round(eager_ms, 1), round(captured_ms, 1),
                round(eager_ms / captured_ms, 2), round(tokens / eager_ms * 1e3), round(tokens / captured_ms * 1e3),
                round(captured_ms / eager_ms, 2), f"{error:.1e}"]
    finally:
        engine.close()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--backends", nargs="+", choices=["auto", "torch", "triton"], default=["torch", "triton"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_capture needs a CUDA device (it times CUDA graph replays)")
    headers = ["shape", "trials", "batch", "backend", "tokens", "eager_ms", "captured_ms", "speedup",
               "eager_tok_s", "captured_tok_s", "eager_gpu_busy", "grad_rel_err"]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, base = materialise(args.shape, Path(tmp))
        table = [measure(args, backend, base, tokenizer) for backend in args.backends]
    path = write_result(
        f"step_capture-{args.shape}", headers, table,
        {"note": "one fixed packed batch; captured = forward+backward replayed from one CUDA graph, then the "
                 "eager AdamW kernel; eager_gpu_busy = captured_ms / eager_ms (the replay is GPU-bound)"},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
