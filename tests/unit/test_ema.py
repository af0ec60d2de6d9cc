"""The EMA in one process: the update against the closed-form average, the update interval, swapping the shadow in
and out, and checkpoint state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlpost.engine.checkpoint import CheckpointError
from rlpost.engine.ema import EMA, EMAConfig


def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(3, 4, generator=gen)), nn.Parameter(torch.randn(5, generator=gen))]


def test_update_equals_closed_form() -> None:
    """After n updates with weights w_1..w_n: shadow = d^n·w_0 + (1-d)·sum_k d^(n-k)·w_k."""
    params, d = _params(), 0.8
    ema = EMA(params, EMAConfig(decay=d))
    history = [[p.detach().double().clone() for p in params]]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen))
        history.append([p.detach().double().clone() for p in params])
        assert ema.update(step)
    n = len(history) - 1
    for i, shadow in enumerate(ema.shadow):
        expected = d**n * history[0][i] + sum((1 - d) * d ** (n - k) * history[k][i] for k in range(1, n + 1))
        assert shadow.dtype == torch.float32
        assert torch.allclose(shadow.double(), expected, atol=1e-6, rtol=0)


def test_update_every() -> None:
    params = _params()
    ema = EMA(params, EMAConfig(decay=0.5, update_every=2))
    start = [s.clone() for s in ema.shadow]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    assert not ema.update(1)
    assert all(torch.equal(a, b) for a, b in zip(start, ema.shadow, strict=True))
    assert ema.update(2)
    assert all(torch.allclose(s, a + 0.5) for a, s in zip(start, ema.shadow, strict=True))


def test_swapped_shows_shadow_and_restores_live_weights_exactly() -> None:
    params = _params()
    ema = EMA(params, EMAConfig(decay=0.5))
    with torch.no_grad():
        for p in params:
            p.mul_(3.0).add_(0.1)
    ema.update(1)
    live = [p.detach().clone() for p in params]
    with ema.swapped():
        for p, s in zip(params, ema.shadow, strict=True):
            assert torch.equal(p.detach(), s)
    for p, before in zip(params, live, strict=True):
        assert torch.equal(p.detach(), before)


def test_state_dict_round_trip_and_errors() -> None:
    params = _params()
    ema = EMA(params, EMAConfig(decay=0.5))
    with torch.no_grad():
        params[0].add_(1.0)
    ema.update(1)
    state = {k: v.clone() for k, v in ema.state_dict().items()}
    assert sorted(state) == ["trainable.0000", "trainable.0001"]
    other = EMA(_params(), EMAConfig(decay=0.5))
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, other.shadow, strict=True))
    with pytest.raises(CheckpointError, match="2 trainable parameters"):
        other.load_state_dict({"trainable.0000": state["trainable.0000"]})
    with pytest.raises(CheckpointError, match="EMA tensor 1"):
        other.load_state_dict({**state, "trainable.0001": torch.zeros(6)})
