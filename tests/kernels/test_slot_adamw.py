"""The slot-stacked AdamW kernel against torch.optim.AdamW, row by row, only as far as each row is live.

Runs on CUDA where there is one, else under ``TRITON_INTERPRET=1`` on CPU tensors (set by the conftest).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kernels.slot_adamw import BLOCK, slot_adamw_

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

# (lr, beta1, beta2, eps, weight decay, clip multiplier) per row
HYPER = [(1e-2, 0.9, 0.999, 1e-8, 0.0, 1.0), (3e-3, 0.8, 0.99, 1e-6, 0.1, 0.5), (1e-1, 0.95, 0.9, 1e-7, 0.01, 1.0)]


@pytest.mark.parametrize(("grad_dtype", "tail"), [(torch.float32, 17), (torch.bfloat16, 32)])
def test_rows_step_as_torch_adamw_up_to_their_live_columns(grad_dtype: torch.dtype, tail: int) -> None:
    """``tail`` 32: every live length a multiple of 16 (the kernel's wide-access variant); 17: not."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    width = 2 * BLOCK + 304  # three programs per row
    live = [width, BLOCK + tail, 0]  # a full row, one ending inside the second program, one not stepped
    params = torch.randn(3, width, generator=g)
    exp_avg = torch.randn(3, width, generator=g) * 0.1
    exp_avg_sq = torch.rand(3, width, generator=g) * 0.01
    grads = (torch.randn(3, width, generator=g) * 0.1).to(grad_dtype)
    step = 3  # bias corrections of a row that has taken two steps before
    table = torch.tensor([
        [clip for *_, clip in HYPER],
        [1 - lr * wd for lr, _, _, _, wd, _ in HYPER],
        [1 - b1 for _, b1, *_ in HYPER],
        [b2 for _, _, b2, *_ in HYPER],
        [1 - b2 for _, _, b2, *_ in HYPER],
        [math.sqrt(1 - b2**step) for _, _, b2, *_ in HYPER],
        [eps for _, _, _, eps, *_ in HYPER],
        [-lr / (1 - b1**step) for lr, b1, *_ in HYPER],
    ], dtype=torch.float32)  # fmt: skip
    on = [t.to(DEVICE, copy=True) for t in (params, exp_avg, exp_avg_sq, grads)]
    compute = torch.full((3, width), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    slot_adamw_(*on, compute, torch.tensor(live, dtype=torch.int32, device=DEVICE), table.to(DEVICE))
    got_p, got_m, got_v, _ = (t.cpu() for t in on)

    for row, (lr, beta1, beta2, eps, wd, clip) in enumerate(HYPER):
        n = live[row]
        p = params[row, :n].clone().requires_grad_()
        reference = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
        state = reference.state[p]
        state["step"] = torch.tensor(float(step - 1))
        state["exp_avg"], state["exp_avg_sq"] = exp_avg[row, :n].clone(), exp_avg_sq[row, :n].clone()
        p.grad = grads[row, :n].float() * clip
        reference.step()
        torch.testing.assert_close(got_p[row, :n], p.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got_m[row, :n], state["exp_avg"], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(got_v[row, :n], state["exp_avg_sq"], rtol=1e-6, atol=1e-10)
        if DEVICE.type == "cuda":
            assert torch.equal(compute[row, :n].cpu(), got_p[row, :n].to(torch.bfloat16))
        else:  # the interpreter converts to bf16 by truncation (Triton 3.9): within one bf16 step
            torch.testing.assert_close(compute[row, :n].float(), got_p[row, :n], rtol=2**-7, atol=0)
        # Past the live columns nothing is read or written: the padding (and a row not stepped) stays put.
        assert torch.equal(got_p[row, n:], params[row, n:]) and torch.equal(got_m[row, n:], exp_avg[row, n:])
        assert torch.equal(got_v[row, n:], exp_avg_sq[row, n:]) and compute[row, n:].isnan().all()
