"""Shared by the tests of the update rules that train against a lagging ``old`` weight copy (DiffusionNFT and TreeNFT,
tests/plugins/nft and tests/plugins/treenft): a toy policy with a frozen reference, a backend that keeps gradients
instead of applying them, and the end-to-end checks on the tiny SD3 (the copy lags by its rate; a resume continues
weights and copy bit for bit)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlpost import TrainBackend
from rlpost.core.plugins import PluginHost
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests.toy_components import ToyPolicy

A_REF = -0.6
"""The toy policy's scale inside :meth:`RefToyPolicy.reference` (the frozen reference)."""


class RefToyPolicy(ToyPolicy):
    """The toy policy with a frozen reference: ``a`` held at :data:`A_REF` inside :meth:`reference`; it records the
    ``guidance`` of every velocity call."""

    guidances: list[float | None]

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Any, guidance: float | None = None) -> Tensor:
        self.guidances = [*getattr(self, "guidances", []), guidance]
        return super().velocity(latents, sigma, cond, guidance)

    @contextmanager
    def reference(self) -> Iterator[None]:
        assert self.a is not None
        saved = self.a.detach().clone()
        with torch.no_grad():
            self.a.fill_(A_REF)
        try:
            yield
        finally:
            with torch.no_grad():
                self.a.copy_(saved)


class RecordingBackend(TrainBackend):
    """Accumulates gradients and, at ``step``, keeps them instead of applying them (so the test can compare them)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.backward_calls = 0
        self.steps = 0
        self.grads: list[Tensor] = []

    def backward(self, loss: Tensor) -> None:
        self.backward_calls += 1
        loss.backward()

    def step(self) -> dict[str, float]:
        self.steps += 1
        self.grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None
        return {"train/grad_norm": 0.0, "train/lr": 0.0}


def run_recipe(host: PluginHost, cfg: dict[str, Any], resume: str | None = None) -> Runner:
    """Validate a recipe dict (a copy) and run it to its end; the finished runner."""
    runner = Runner(validate(json.loads(json.dumps(cfg)), host), host, resume=resume)
    runner.run()
    return runner


def check_old_copy_lags(runner: Runner, start: list[Tensor], copy: str, decay: float) -> None:
    """After one step from weights ``start``: the step trained something, and the copy is the soft update with
    ``decay`` of the start towards the live weights, ``old = decay·start + (1 - decay)·live``."""
    assert runner.backend is not None and runner.copies is not None
    live = runner.backend.parameters
    assert any(not torch.equal(p.detach(), s) for p, s in zip(live, start, strict=True)), "the step trained nothing"
    for s, p, p0 in zip(runner.copies.shadows[copy], live, start, strict=True):
        torch.testing.assert_close(s, decay * p0 + (1.0 - decay) * p.detach(), rtol=1e-5, atol=1e-7)


def check_resume_bitwise(host: PluginHost, cfg: Callable[[Path, int], dict[str, Any]], tmp: Path, copy: str) -> None:
    """2 steps equal 1 step + resume + 1 step: the LoRA weights and the weight copy ``copy`` (saved in the run state),
    hence the second rollout, which runs under the copy. ``cfg(output_dir, steps)`` builds the recipe."""
    a = run_recipe(host, cfg(tmp / "a", 2))
    run_recipe(host, cfg(tmp / "b", 1))
    b = run_recipe(host, cfg(tmp / "b", 2), resume="latest")
    assert a.backend is not None and b.backend is not None and a.copies is not None and b.copies is not None
    for x, y in zip(a.backend.parameters, b.backend.parameters, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a.copies.shadows[copy], b.copies.shadows[copy], strict=True):
        assert torch.equal(x, y)
    hist_a = [m["reward/weighted"] for m in a.ctx.history]
    hist_b = json.loads((tmp / "b" / "metrics.jsonl").read_text().splitlines()[-1])["reward/weighted"]
    assert hist_b == hist_a[-1]
