"""Named weight copies (rlpost/engine/weight_copies.py): the decay law, swapping a copy in and back exactly, the
frozen reference under its reserved name, checkpoint state round trips, CPU offload, and the recipe checks."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from rlpost.core.api import REFERENCE
from rlpost.engine.checkpoint import CheckpointError
from rlpost.engine.weight_copies import CopyConfig, EngineCopies, copies_problems


class _Policy:
    """The part of a policy EngineCopies uses: ``reference()`` (here: zeroes the weights while inside)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.in_reference = False

    @contextmanager
    def reference(self):
        self.in_reference = True
        try:
            yield
        finally:
            self.in_reference = False


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3, 4, generator=g)), nn.Parameter(torch.randn(5, generator=g))]


def test_decay_law_covers_the_published_schedules():
    nft_type1 = CopyConfig(rate=0.001, cap=0.5)
    assert nft_type1.decay(0) == 0.0 and nft_type1.decay(100) == pytest.approx(0.1)
    assert nft_type1.decay(10**6) == 0.5
    nft_type2 = CopyConfig(rate=0.0075, cap=0.999, delay=75)
    assert (
        nft_type2.decay(75) == 0.0 and nft_type2.decay(85) == pytest.approx(0.075) and nft_type2.decay(10**4) == 0.999
    )
    ema_ref = CopyConfig(rate=0.001, cap=0.3)
    assert ema_ref.decay(200) == pytest.approx(0.2) and ema_ref.decay(400) == pytest.approx(0.3)


def test_copy_starts_at_live_weights_and_follows_the_recursion():
    params = _params()
    copies = EngineCopies(_Policy(params), params, {"old": CopyConfig(rate=0.25, cap=0.5)})
    start = [p.detach().clone() for p in params]
    assert all(torch.equal(s, p) for s, p in zip(copies.shadows["old"], start, strict=True))
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    metrics = copies.update(1)  # d = 0.25: old = 0.25·start + 0.75·(start + 1)
    assert metrics == {"copies/old_decay": 0.25}
    for s, p0 in zip(copies.shadows["old"], start, strict=True):
        assert torch.allclose(s, p0 + 0.75, atol=1e-6)
    copies.update(2)  # d = 0.5: old = 0.5·old + 0.5·live
    for s, p0 in zip(copies.shadows["old"], start, strict=True):
        assert torch.allclose(s, 0.5 * (p0 + 0.75) + 0.5 * (p0 + 1.0), atol=1e-6)


def test_update_every_skips_steps():
    params = _params()
    copies = EngineCopies(_Policy(params), params, {"old": CopyConfig(rate=0.0, cap=0.0, update_every=2)})
    with torch.no_grad():
        params[0].add_(1.0)
    assert copies.update(1) == {}
    assert not torch.equal(copies.shadows["old"][0], params[0])
    copies.update(2)
    assert torch.allclose(copies.shadows["old"][0], params[0].detach(), atol=1e-6)  # d = 0: the live weights


def test_use_swaps_the_copy_in_and_restores_the_live_weights_exactly():
    params = _params()
    copies = EngineCopies(_Policy(params), params, {"old": CopyConfig(rate=0.0, cap=0.0)})
    live = [p.detach().clone() for p in params]
    copies.shadows["old"][0].fill_(7.0)
    with copies.use("old"):
        assert torch.equal(params[0], torch.full_like(params[0], 7.0))
        assert not torch.is_grad_enabled()
    assert all(torch.equal(p, w) for p, w in zip(params, live, strict=True))
    with pytest.raises(KeyError, match="no weight copy 'ema'.*reference, old"):
        copies.use("ema")


def test_reference_and_live_names():
    params = _params()
    policy = _Policy(params)
    copies = EngineCopies(policy, params, {})
    assert copies.names() == (REFERENCE,)
    with copies.use(REFERENCE):
        assert policy.in_reference
    with copies.use("live"):
        assert not policy.in_reference


def test_state_round_trip_and_offload():
    params = _params()
    cfg = {"old": CopyConfig(rate=0.1, cap=0.5, offload=True), "ema": CopyConfig(rate=0.001, cap=0.3)}
    copies = EngineCopies(_Policy(params), params, cfg)
    assert all(t.device.type == "cpu" for t in copies.shadows["old"])
    with torch.no_grad():
        params[1].mul_(3.0)
    copies.update(3)
    state = copies.state_dict()
    other = EngineCopies(_Policy(_params(1)), _params(1), cfg)
    other.load_state_dict(state)
    for name in cfg:
        for a, b in zip(copies.shadows[name], other.shadows[name], strict=True):
            assert torch.equal(a, b)  # checkpoints restore copies bit for bit (resume within one process)
    with pytest.raises(CheckpointError, match="no weight copy"):
        other.load_state_dict({"old": state["old"]})
    with pytest.raises(CheckpointError, match="2 trainable parameters"):
        other.load_state_dict({"old": state["old"], "ema": {"trainable.0000": state["ema"]["trainable.0000"]}})


def test_recipe_problems_name_the_field_and_the_missing_copy():
    problems = copies_problems(
        {"Old": CopyConfig(), "reference": CopyConfig(), "ema": CopyConfig(cap=2.0, delay=-1)},
        frozenset({"old", "reference"}),
        "nft",
    )
    text = "\n".join(problems)
    assert "copies.Old: the name must be lower-case" in text
    assert "copies.reference: the name is reserved" in text
    assert "copies.ema.cap: must be in [0, 1], got 2.0" in text
    assert "copies.ema.delay: must be >= 0" in text
    assert "optimizer 'nft' needs a weight copy 'old'" in text
    assert "'reference'" not in text.split("needs a weight copy")[-1].split("\n")[0].replace("'old'", "")


def test_a_copy_used_between_a_live_forward_and_backward_keeps_the_gradient_right():
    """Autograd saved the live parameter for backward; swapping a copy in and out (no grad) in between must neither
    trip autograd's in-place check nor change the gradient."""
    params = _params()
    copies = EngineCopies(_Policy(params), params, {"old": CopyConfig(rate=0.0, cap=0.0)})
    copies.shadows["old"][0].fill_(3.0)
    live = params[0].pow(2).sum()  # pow saves params[0] itself for backward
    with copies.use("old"):
        old = params[0].pow(2).sum()
    live.backward()
    assert params[0].grad is not None
    torch.testing.assert_close(params[0].grad, 2 * params[0].detach())
    assert float(old) == pytest.approx(9.0 * 12)
