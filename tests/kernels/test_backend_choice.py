"""What `auto` picks (issue 15): Triton only for wide layers in packs of many slots, where it was measured
faster on an H100, and for every wide layer on a rank of a pack over several GPUs, whose steps are never captured
(issue 37); the torch path elsewhere (small, host-bound shapes) and wherever CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from kernels import set_backend
from kernels.lora_linear import auto_backend, resolve_backend


@pytest.mark.parametrize(("d_in", "slots", "want"), [
    (2048, 32, "triton"),  # Llama-3.2-1B's projections in a 32-trial pack
    (8192, 32, "triton"),  # its down_proj
    (576, 24, "torch"),  # SmolLM2-135M: host-bound, Triton's launches cost more than they save
    (1536, 24, "torch"),
    (4096, 8, "torch"),  # Llama-3.1-8B with 8 trials: the torch path measured faster
])
def test_auto_takes_triton_only_where_it_was_measured_faster(d_in: int, slots: int, want: str) -> None:
    assert auto_backend(d_in, slots) == want


@pytest.mark.parametrize(("d_in", "slots", "want"), [
    (4096, 8, "triton"),  # Llama-3.1-8B, 8 trials a rank: 0.91x -> 1.08x one GPU on two H200s
    (4096, 1, "triton"),
    (576, 24, "torch"),  # narrow layers stay on the torch path
])
def test_auto_takes_triton_for_wide_layers_on_a_rank_whose_steps_are_not_captured(d_in: int, slots: int,
                                                                                  want: str) -> None:
    assert auto_backend(d_in, slots, uncaptured=True) == want


def test_auto_is_the_torch_path_off_cuda_and_an_explicit_choice_wins() -> None:
    x = torch.zeros(4, 4096)
    assert resolve_backend(x, slots=64) == "torch"
    assert resolve_backend(x, slots=8, uncaptured=True) == "torch"
    set_backend("torch")
    try:
        assert resolve_backend(torch.zeros(4, 4096, device="cuda" if torch.cuda.is_available() else "cpu"),
                               slots=64) == "torch"
    finally:
        set_backend("auto")
