"""Counter-based dropout masks: deterministic, the right keep rate, no int64 overflow; compiled == eager."""

from __future__ import annotations

import pytest
import torch

from kernels import DropoutKeys, LayerDropout, keep_threshold, mix32
from kernels.dropout import MASK32, _kept


def _multipliers(p: list[float], d: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """K for one token per entry of ``p`` over ``d`` features: ``apply`` on ones."""
    n = len(p)
    keys = DropoutKeys(
        token_keys=mix32(torch.arange(n, dtype=torch.int64)).to(device),
        threshold=torch.tensor([keep_threshold(q) for q in p], dtype=torch.int64, device=device),
        inv_keep=torch.tensor([1 / (1 - q) for q in p], dtype=torch.float32, device=device),
    )
    features = mix32(torch.arange(d, dtype=torch.int64) ^ 0xABCDEF).to(device)
    return LayerDropout(keys, features).apply(torch.ones(n, d, device=device))


def test_mix32_is_the_same_on_ints_and_tensors_and_stays_in_32_bits() -> None:
    values = [0, 1, 2, 12345, MASK32 - 1, MASK32]
    mixed = mix32(torch.tensor(values, dtype=torch.int64))
    assert mixed.tolist() == [mix32(v) for v in values]
    assert int(mixed.min()) >= 0 and int(mixed.max()) <= MASK32
    assert len(set(mixed.tolist())) == len(values)  # a bijection on [0, 2**32)
    assert mix32(0) == 0 and mix32(1) != 1


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_keep_rate_and_values(p: float) -> None:
    keep = _multipliers([p] * 512, 256)
    assert keep.shape == (512, 256)
    assert ((keep == 0) | (keep == torch.tensor(1 / (1 - p)))).all()
    kept = (keep > 0).float()
    assert kept.mean().item() == pytest.approx(1 - p, abs=0.01)
    if p > 0:  # rows and columns are not copies of each other
        assert 0 < kept.mean(0).min() and kept.mean(0).max() < 1 and 0 < kept.mean(1).min()
    assert torch.equal(keep, _multipliers([p] * 512, 256))  # a pure function of the keys


def test_per_token_probabilities() -> None:
    keep = _multipliers([0.0, 0.9, 0.0, 0.5], 4096)
    assert keep[0].eq(1).all() and keep[2].eq(1).all()
    assert (keep[1] > 0).float().mean().item() == pytest.approx(0.1, abs=0.02)
    assert (keep[3] > 0).float().mean().item() == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="outside"):
        keep_threshold(1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel runs on CUDA")
def test_the_compiled_kernel_equals_the_eager_function() -> None:
    cuda = torch.device("cuda")
    x = torch.randn(300, 512, device=cuda, dtype=torch.bfloat16)
    keys = DropoutKeys(
        token_keys=mix32(torch.arange(300, dtype=torch.int64, device=cuda) + 17),
        threshold=torch.full((300,), keep_threshold(0.3), dtype=torch.int64, device=cuda),
        inv_keep=torch.full((300,), 1 / 0.7, device=cuda),
    )
    dropout = LayerDropout(keys, mix32(torch.arange(512, dtype=torch.int64, device=cuda)))
    eager = _kept(keys.token_keys, dropout.feature_keys, keys.threshold)
    got = dropout.apply(x)
    assert torch.equal(got, torch.where(eager, x * keys.inv_keep[:, None].to(x.dtype), 0))
    # Another token count (every step has its own): the same dynamic-shape kernel, the same mask.
    first = DropoutKeys(keys.token_keys[:77], keys.threshold[:77], keys.inv_keep[:77])
    assert torch.equal(LayerDropout(first, dropout.feature_keys).apply(x[:77]), got[:77])
