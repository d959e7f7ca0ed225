"""SlotAdamW against torch.optim.AdamW + clip_grad_norm_, slot by slot."""

from __future__ import annotations

import pytest
import torch

from worker.engine import lr_at
from worker.engine.optim import AdamWHyper, SlotAdamW

P, SPLIT = 40, 15  # each slot's row is two "parameters" for the reference: [:SPLIT] and [SPLIT:]
HYPER = [
    AdamWHyper(),
    AdamWHyper(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, max_grad_norm=0.05),  # clips every step
    AdamWHyper(beta1=0.95, beta2=0.9, eps=1e-7, weight_decay=0.01, max_grad_norm=100.0),  # never clips
]
SCHEDULES = [("constant", 0), ("cosine", 2), ("linear", 1)]
JOINS = [0, 0, 2]  # slot 2 is admitted at step 2
SKIPS = {(0, 3)}  # slot 0 takes no part in step 3
DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_matches_torch_adamw_and_clip_grad_norm_per_slot(device: torch.device) -> None:
    """On CUDA the update is one Triton kernel (``kernels.slot_adamw``) that also refreshes a bf16 compute copy."""
    torch.manual_seed(0)
    params = torch.randn(3, P).to(device)
    grads = torch.zeros(3, P, device=device)
    compute = params.to(torch.bfloat16)
    optimizer = SlotAdamW(params, grads, compute)
    references: dict[int, tuple[list[torch.Tensor], torch.optim.AdamW]] = {}
    own_step = [0, 0, 0]
    for step in range(6):
        lrs = {}
        for slot, hyper in enumerate(HYPER):
            if step == JOINS[slot]:
                optimizer.reset(slot, hyper)
                tensors = [params[slot, :SPLIT].clone().requires_grad_(), params[slot, SPLIT:].clone().requires_grad_()]
                references[slot] = (tensors, torch.optim.AdamW(
                    tensors, lr=1.0, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, weight_decay=hyper.weight_decay
                ))
            if step >= JOINS[slot] and (slot, step) not in SKIPS:
                schedule, warmup = SCHEDULES[slot]
                lrs[slot] = lr_at(own_step[slot], base_lr=1e-2, max_steps=8, warmup_steps=warmup, schedule=schedule)
        grads.copy_(torch.randn(3, P) * 0.1)
        fresh_grads, before = grads.clone(), params.clone()  # the update clips grads in place, as clip_grad_norm_
        optimizer.step(lrs)
        for slot, (tensors, reference) in references.items():
            if slot not in lrs:
                assert torch.equal(params[slot], before[slot]), "a slot not stepped must not move"
                continue
            tensors[0].grad, tensors[1].grad = fresh_grads[slot, :SPLIT], fresh_grads[slot, SPLIT:]
            max_norm = HYPER[slot].max_grad_norm
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(tensors, max_norm)
            for group in reference.param_groups:
                group["lr"] = lrs[slot]
            reference.step()
            own_step[slot] += 1
            want = torch.cat([t.detach() for t in tensors])
            torch.testing.assert_close(params[slot], want, rtol=1e-6, atol=1e-7)
            state = [reference.state[t] for t in tensors]
            torch.testing.assert_close(optimizer.exp_avg[slot], torch.cat([s["exp_avg"] for s in state]),
                                       rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(optimizer.exp_avg_sq[slot], torch.cat([s["exp_avg_sq"] for s in state]),
                                       rtol=1e-6, atol=1e-12)
    assert optimizer.steps == own_step == [5, 6, 4]
    assert torch.equal(compute, params.to(torch.bfloat16))


def test_clear_forgets_a_slot() -> None:
    params, grads = torch.randn(2, 8), torch.randn(2, 8)
    optimizer = SlotAdamW(params, grads)
    optimizer.reset(1, AdamWHyper())
    optimizer.step({1: 0.1})
    assert optimizer.exp_avg[1].any() and optimizer.steps[1] == 1
    optimizer.clear(1)
    assert not optimizer.exp_avg[1].any() and not optimizer.exp_avg_sq[1].any() and optimizer.steps[1] == 0
    assert optimizer.hyper[1] is None
