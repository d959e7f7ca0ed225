"""``lora_delta`` against the per-segment loop oracle: outputs and gradients for x, A and B."""

from __future__ import annotations

import pytest
import torch

import kernels.layouts
from kernels import DropoutKeys, LayerDropout, build_segments, keep_threshold, lora_delta
from kernels.reference import lora_delta_loop

D_IN, D_OUT, R_MAX = 16, 24, 8  # multiples of 8: the grouped_mm path's alignment, on GPUs that have it
RANKS = [8, 2, 5, 3]  # slot z's true rank; A / B are zero beyond it

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
CASES = {
    "uniform, every slot in order": ([0, 1, 2, 3], [4, 4, 4, 4]),
    "uniform, permuted, slot 1 and 3 absent": ([2, 0], [3, 3]),
    "ragged, single-token segment, slot 2 absent": ([1, 3, 0], [5, 1, 3]),
    "single tokens, slots repeated": ([0, 1, 0, 1], [1, 1, 1, 1]),
    "ragged, a slot twice": ([2, 2, 0], [2, 5, 1]),
}


def _weights(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(len(RANKS), D_IN, R_MAX, generator=g) / D_IN**0.5
    b = torch.randn(len(RANKS), R_MAX, D_OUT, generator=g)
    for z, rank in enumerate(RANKS):
        a[z, :, rank:] = 0.0
        b[z, rank:, :] = 0.0
    scale = torch.tensor([2.0, 0.5, 1.0, 4.0])
    return a.to(device, dtype), b.to(device, dtype), scale.to(device)


def _run(
    fn_name: str,
    slots: list[int],
    lengths: list[int],
    device: torch.device,
    dtype: torch.dtype,
    dropout: LayerDropout | None,
    with_base: bool,
) -> tuple[torch.Tensor, ...]:
    """Output and gradients (x, A, B, and base if any) of one implementation under a fixed upstream gradient."""
    n = sum(lengths)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, D_IN, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(n, D_OUT, generator=g).to(device, dtype)
    base = torch.randn(n, D_OUT, generator=g).to(device, dtype).requires_grad_() if with_base else None
    a, b, scale = _weights(device, dtype)
    a.requires_grad_()
    b.requires_grad_()
    if fn_name == "lora_delta":
        meta = build_segments(slots, lengths, num_slots=len(RANKS), device=device)
        # base is added to in place: give it a non-leaf view, as the engine's layers do.
        y = lora_delta(x, a, b, scale, meta, dropout, None if base is None else base.clone().view(-1, D_OUT))
    else:
        keep = None if dropout is None else dropout.apply(torch.ones_like(x))  # the multipliers K themselves
        y = lora_delta_loop(x, a, b, scale, slots, lengths, keep, base)
    (y.float() * dy.float()).sum().backward()
    assert x.grad is not None and a.grad is not None and b.grad is not None
    grads = (x.grad, a.grad, b.grad) if base is None else (x.grad, a.grad, b.grad, base.grad)
    return (y.detach(), *grads)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("with_base", [False, True], ids=["delta", "base+delta"])
@pytest.mark.parametrize("grouped", [False, True], ids=["auto-layout", "grouped_mm"])
def test_matches_the_loop_oracle(
    device: torch.device,
    dtype: torch.dtype,
    case: str,
    dropout: bool,
    with_base: bool,
    grouped: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``grouped``: ragged segments through torch._grouped_mm even where it is not the default (its CPU
    fallback runs the same code path's shapes)."""
    slots, lengths = CASES[case]
    if grouped:
        monkeypatch.setattr(kernels.layouts, "grouped_mm_supported", lambda x, dims: True)
    layer_dropout = None
    if dropout:
        n = sum(lengths)
        keys = DropoutKeys(
            token_keys=torch.arange(n, dtype=torch.int64, device=device) * 7919,
            threshold=torch.full((n,), keep_threshold(0.25), dtype=torch.int64, device=device),
            inv_keep=torch.full((n,), 1 / 0.75, device=device),
        )
        layer_dropout = LayerDropout(keys, torch.arange(D_IN, dtype=torch.int64, device=device) * 104729)
    got = _run("lora_delta", slots, lengths, device, dtype, layer_dropout, with_base)
    want = _run("loop", slots, lengths, device, dtype, layer_dropout, with_base)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, w in zip(["y", "dx", "dA", "dB", "dbase"], got, want, strict=False):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol, msg=f"{name} differs")

    d_a, d_b = got[2], got[3]
    for z, rank in enumerate(RANKS):
        # Padded ranks, and slots without tokens, get exactly zero gradient.
        assert not d_a[z, :, rank:].any() and not d_b[z, rank:, :].any()
        if z not in slots:
            assert not d_a[z].any() and not d_b[z].any()


def test_a_slot_with_scale_zero_contributes_nothing() -> None:
    cpu = torch.device("cpu")
    a, b, scale = _weights(cpu, torch.float32)
    scale[1] = 0.0  # slot 1 does not target this layer
    a.requires_grad_()
    b.requires_grad_()
    x = torch.randn(6, D_IN)
    y = lora_delta(x, a, b, scale, build_segments([0, 1], [3, 3], num_slots=len(RANKS), device=cpu))
    assert not y[3:].any() and y[:3].abs().sum() > 0
    y.sum().backward()
    assert a.grad is not None and b.grad is not None
    assert not a.grad[1].any() and not b.grad[1].any() and a.grad[0].any()


def test_no_tokens_gives_an_empty_result() -> None:
    cpu = torch.device("cpu")
    a, b, scale = _weights(cpu, torch.float32)
    y = lora_delta(torch.zeros(0, D_IN), a, b, scale, build_segments([], [], num_slots=len(RANKS), device=cpu))
    assert y.shape == (0, D_OUT)


def test_gradients_of_a_and_b_accumulate_into_given_buffers() -> None:
    cpu = torch.device("cpu")
    a, b, scale = _weights(cpu, torch.float32)
    a.requires_grad_()
    b.requires_grad_()
    slots, lengths = CASES["ragged, a slot twice"]
    x = torch.randn(sum(lengths), D_IN)
    meta = build_segments(slots, lengths, num_slots=len(RANKS), device=cpu)
    lora_delta(x, a, b, scale, meta).square().sum().backward()
    assert a.grad is not None and b.grad is not None
    want_a, want_b = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    # A flat store whose rows hold both, with something already in it: backward adds, autograd sees nothing.
    store = torch.ones(len(RANKS), D_IN * R_MAX + R_MAX * D_OUT)
    grad_a = store[:, : D_IN * R_MAX].view(len(RANKS), D_IN, R_MAX)
    grad_b = store[:, D_IN * R_MAX :].view(len(RANKS), R_MAX, D_OUT)
    lora_delta(x, a, b, scale, meta, grad_a=grad_a, grad_b=grad_b).square().sum().backward()
    assert a.grad is None and b.grad is None
    torch.testing.assert_close(grad_a, want_a + 1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_b, want_b + 1, rtol=1e-6, atol=1e-6)
