"""The Triton LoRA kernels against a float64 reference: outputs and every gradient, poisoned outputs.

Runs on CUDA where there is one, else under ``TRITON_INTERPRET=1`` on CPU tensors (set by the conftest).
Every check draws fresh random inputs; shapes straddle the token and feature tiles; one slot has no tokens,
one has scale 0 (it does not target this layer); ranks go from 1 to 128.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

import kernels.triton_lora as triton_lora
from kernels import DropoutKeys, LayerDropout, build_segments, keep_threshold, lora_linear, mix32, set_backend
from kernels.reference import lora_delta_loop

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
if DEVICE.type == "cpu":
    # The interpreter converts fp32 to bf16 by truncation (Triton 3.9), not round-to-nearest as the GPU
    # does: twice the rounding error, and biased. fp16 goes through numpy and rounds correctly.
    TOLERANCE[torch.bfloat16] = 2e-2


@dataclass(frozen=True)
class Case:
    slots: list[int]
    lengths: list[int]
    ranks: list[int]  # true rank of each slot; A / B are zero beyond it (r_max = max)
    scales: list[float]
    d_in: int = 72
    d_out: int = 40


CASES = {
    # Segments of 65, 1, 130 and 63 tokens straddle the 64-token blocks; slot 2 has no tokens; slot 3's scale
    # is 0; slot 1 appears twice.
    "ragged": Case([1, 3, 0, 1], [65, 1, 130, 63], ranks=[8, 1, 16, 5], scales=[2.0, 0.5, 1.0, 0.0]),
    "rank 1 and 128": Case([2, 0, 1], [40, 70, 90], ranks=[1, 128, 37], scales=[1.0, 0.25, 4.0], d_in=96, d_out=136),
    # One long segment: dA and dB split the slot's token blocks over several programs (fp32 partials).
    "one slot": Case([0], [600], ranks=[16], scales=[2.0], d_in=64, d_out=64),
}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the kernels fill starts as NaN: an element they fail to write fails the comparison."""

    def nan_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_lora, "_new_output", nan_output)


def _inputs(case: Case, dtype: torch.dtype, dropout_p: float, with_bias: bool, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    n, z, r_max = sum(case.lengths), len(case.ranks), max(case.ranks)
    a = torch.randn(z, case.d_in, r_max, generator=g) / case.d_in**0.5
    b = torch.randn(z, r_max, case.d_out, generator=g) / r_max**0.5
    for slot, rank in enumerate(case.ranks):
        a[slot, :, rank:] = 0.0
        b[slot, rank:, :] = 0.0
    dropout = None
    if dropout_p > 0:
        token_keys = mix32(torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64))
        keys = DropoutKeys(
            token_keys=token_keys.to(DEVICE),
            threshold=torch.full((n,), keep_threshold(dropout_p), dtype=torch.int64, device=DEVICE),
            inv_keep=torch.full((n,), 1.0 / (1.0 - dropout_p), device=DEVICE),
        )
        features = mix32(torch.arange(case.d_in, dtype=torch.int64) ^ 0x5BD1E995).to(DEVICE)
        dropout = LayerDropout(keys, features)
    return {
        "x": torch.randn(n, case.d_in, generator=g).to(DEVICE, dtype),
        "weight": (torch.randn(case.d_out, case.d_in, generator=g) / case.d_in**0.5).to(DEVICE, dtype),
        "bias": torch.randn(case.d_out, generator=g).to(DEVICE, dtype) if with_bias else None,
        "a": a.to(DEVICE, dtype),
        "b": b.to(DEVICE, dtype),
        "scale": torch.tensor(case.scales, device=DEVICE),
        "dy": torch.randn(n, case.d_out, generator=g).to(DEVICE, dtype),
        "dropout": dropout,
    }


def _reference(case: Case, t: dict[str, object]) -> tuple[torch.Tensor, ...]:
    """y, dx, dA, dB in float64 from the per-segment loop, with the same dropout multipliers."""
    f64 = {k: v.detach().double().requires_grad_() for k, v in t.items() if k in ("x", "a", "b")}
    weight, bias, dy = (t[k] for k in ("weight", "bias", "dy"))
    dropout = t["dropout"]
    keep = None
    if isinstance(dropout, LayerDropout):
        keep = dropout.apply(torch.ones_like(f64["x"]))  # K itself, in float64
    assert isinstance(weight, torch.Tensor) and isinstance(dy, torch.Tensor) and isinstance(t["scale"], torch.Tensor)
    base = f64["x"] @ weight.double().T + (bias.double() if isinstance(bias, torch.Tensor) else 0.0)
    y = lora_delta_loop(f64["x"], f64["a"], f64["b"], t["scale"].double(), case.slots, case.lengths, keep, base)
    y.backward(dy.double())
    return y.detach(), f64["x"].grad, f64["a"].grad, f64["b"].grad  # type: ignore[return-value]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.cpu()).norm() / want.norm().clamp_min(1e-30).cpu())


@pytest.mark.parametrize(
    ("case_name", "dtype", "dropout_p", "with_bias", "grad_store"),
    [
        ("ragged", torch.float32, 0.0, False, True),
        ("ragged", torch.bfloat16, 0.3, True, True),
        ("ragged", torch.float16, 0.0, False, False),
        ("rank 1 and 128", torch.bfloat16, 0.0, False, True),
        ("rank 1 and 128", torch.float32, 0.1, True, False),
        ("one slot", torch.bfloat16, 0.5, False, True),
    ],
)
def test_matches_float64_reference(
    case_name: str, dtype: torch.dtype, dropout_p: float, with_bias: bool, grad_store: bool
) -> None:
    case = CASES[case_name]
    t = _inputs(case, dtype, dropout_p, with_bias, seed=int(torch.randint(0, 2**31, ())))
    want = _reference(case, t)
    x = t["x"].detach().requires_grad_()  # type: ignore[union-attr]
    a = t["a"].detach().requires_grad_()  # type: ignore[union-attr]
    b = t["b"].detach().requires_grad_()  # type: ignore[union-attr]
    # A gradient store already holding earlier values: the kernels add into it.
    grad_a = torch.randn(a.shape, device=DEVICE).to(dtype) * 0.1 if grad_store else None
    grad_b = torch.randn(b.shape, device=DEVICE).to(dtype) * 0.1 if grad_store else None
    before = (None if grad_a is None else grad_a.clone(), None if grad_b is None else grad_b.clone())
    meta = build_segments(case.slots, case.lengths, num_slots=len(case.ranks), device=DEVICE)
    set_backend("triton")
    try:
        y = lora_linear(x, t["weight"], t["bias"], a, b, t["scale"], meta, t["dropout"], grad_a, grad_b)  # type: ignore[arg-type]
        y.backward(t["dy"])
    finally:
        set_backend("auto")
    got_da = a.grad if grad_a is None else grad_a.double() - before[0].double()  # type: ignore[union-attr]
    got_db = b.grad if grad_b is None else grad_b.double() - before[1].double()  # type: ignore[union-attr]
    assert got_da is not None and got_db is not None and x.grad is not None
    tol = TOLERANCE[dtype]
    errors = {
        "y": _rel_err(y.detach(), want[0]),
        "dx": _rel_err(x.grad, want[1]),
        "dA": _rel_err(got_da, want[2]),
        "dB": _rel_err(got_db, want[3]),
    }
    assert all(err < tol for err in errors.values()), f"relative errors {errors} (tolerance {tol})"
    # Rank padding gets exactly zero gradient: AdamW must never move it.
    for slot, rank in enumerate(case.ranks):
        assert torch.count_nonzero(got_da[slot, :, rank:]) == 0
        assert torch.count_nonzero(got_db[slot, rank:, :]) == 0


def test_input_without_grad_and_a_slot_without_tokens_anywhere() -> None:
    """x that needs no gradient (a first layer under a frozen embedding) skips dX; an unrouted slot's
    gradient stays exactly zero."""
    case = Case([0], [90], ranks=[4, 8], scales=[1.0, 1.0], d_in=32, d_out=48)
    t = _inputs(case, torch.float32, 0.0, False, seed=7)
    want = _reference(case, t)
    a = t["a"].detach().requires_grad_()  # type: ignore[union-attr]
    b = t["b"].detach().requires_grad_()  # type: ignore[union-attr]
    meta = build_segments(case.slots, case.lengths, num_slots=2, device=DEVICE)
    set_backend("triton")
    try:
        y = lora_linear(t["x"], t["weight"], None, a, b, t["scale"], meta)  # type: ignore[arg-type]
        y.backward(t["dy"])
    finally:
        set_backend("auto")
    assert a.grad is not None and b.grad is not None
    assert _rel_err(y.detach(), want[0]) < 1e-3 and _rel_err(a.grad, want[2]) < 1e-3
    assert torch.count_nonzero(a.grad[1]) == 0 and torch.count_nonzero(b.grad[1]) == 0


def test_few_long_slots_split_their_token_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The "one slot" case above takes the split path (several programs per slot, partial sums added)."""
    kernel = triton_lora._outer_kernel
    grids: list[tuple[int, int, int]] = []

    class Spy:
        def __getitem__(self, grid: tuple[int, int, int]) -> object:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_lora, "_outer_kernel", Spy())
    test_matches_float64_reference("one slot", torch.bfloat16, 0.0, False, True)
    assert len(grids) == 2 and all(grid[0] > 1 for grid in grids), grids  # dB and dA: 1 slot x split > 1


def test_step_tables_follow_the_segments() -> None:
    meta = build_segments([1, 0, 1], [70, 0, 5], num_slots=3, device=DEVICE)
    tables = triton_lora.step_tables(meta)
    assert triton_lora.step_tables(meta) is tables  # built once per step
    blocks = list(
        zip(tables.blk_slot.tolist(), tables.blk_start.tolist(), tables.blk_end.tolist(), strict=True)
    )
    assert blocks == [(1, 0, 64), (1, 64, 70), (1, 70, 75)]
    assert tables.slot_blocks.tolist() == [0, 0, 3, 3]
    assert tables.num_blocks == 3 and tables.active_slots == 1 and tables.max_slot_blocks == 3


def test_wide_layers_split_their_columns_over_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few token blocks and many output columns: each block's columns go to several programs (``shares``),
    each recomputing the block's shrink; the "rank 1 and 128" case checks the result against float64."""
    kernel = triton_lora._lora_term_kernel
    grids: list[tuple[int, int]] = []

    class Spy:
        def __getitem__(self, grid: tuple[int, int]) -> object:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_lora, "_num_sms", lambda device: 16)
    monkeypatch.setattr(triton_lora, "_lora_term_kernel", Spy())
    test_matches_float64_reference("rank 1 and 128", torch.bfloat16, 0.0, False, True)
    # The forward's 136 output columns go to two programs per block; the backward's 96 fit one 128-column share.
    assert [grid[0] for grid in grids] == [2, 1], grids


def test_padding_spans_get_no_lora_term_and_give_no_gradient() -> None:
    """Right padding (``pad_spans``): the Triton path writes only the base output there and leaves it out of
    dA / dB; where the upstream gradient is zero on the padding (as in training), every gradient matches
    the float64 reference, and so do the outputs of the real tokens."""
    case = CASES["ragged"]  # segments [0, 65) [65, 66) [66, 196) [196, 259)
    pads = [(40, 65), (150, 196), (250, 259)]
    t = _inputs(case, torch.float32, 0.2, True, seed=int(torch.randint(0, 2**31, ())))
    padded = torch.zeros(sum(case.lengths), dtype=torch.bool)
    for start, end in pads:
        padded[start:end] = True
    dy = t["dy"]
    assert isinstance(dy, torch.Tensor)
    dy[padded.to(DEVICE)] = 0.0
    want = _reference(case, t)
    x = t["x"].detach().requires_grad_()  # type: ignore[union-attr]
    a = t["a"].detach().requires_grad_()  # type: ignore[union-attr]
    b = t["b"].detach().requires_grad_()  # type: ignore[union-attr]
    meta = build_segments(case.slots, case.lengths, num_slots=len(case.ranks), device=DEVICE, pad_spans=pads)
    assert triton_lora.step_tables(meta).blk_slot.tolist().count(-1) == 3  # one block per span
    set_backend("triton")
    try:
        y = lora_linear(x, t["weight"], t["bias"], a, b, t["scale"], meta, t["dropout"])  # type: ignore[arg-type]
        y.backward(dy)
    finally:
        set_backend("auto")
    assert a.grad is not None and b.grad is not None and x.grad is not None
    real = ~padded
    assert _rel_err(y.detach()[real.to(DEVICE)], want[0][real]) < 1e-3
    base = x.detach() @ t["weight"].T + t["bias"]  # type: ignore[union-attr, operator]
    torch.testing.assert_close(y.detach()[padded.to(DEVICE)], base[padded.to(DEVICE)])
    for got, expected in zip((x.grad, a.grad, b.grad), want[1:], strict=True):
        assert _rel_err(got, expected) < 1e-3
