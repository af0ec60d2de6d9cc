"""The worked likelihood-free rule of docs/writing_plugins.md (docs/examples/likelihood_free_rule.py) through the
engine: its gradient equals the paper-style loss written out here by hand, ``validate`` accepts it with any sampler
providing clean samples, and a run whose rollouts use a weight copy ("old") resumes bit for bit, copies included."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from rlpost import hookimpl
from rlpost.apps.host import build_host
from rlpost.core.api import Advantages, TrainBackend, UpdateContext
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from rlpost.ops.training_noise import grid_permutations, noise_for, sample_keys
from rlpost.testing.inputs import sample_rollout
from tests import toy_components
from tests.toy_components import ToyChainSampler, ToyPolicy, toy_recipe

ROOT = Path(__file__).resolve().parents[2]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "likelihood_free_rule", ROOT / "docs/examples/likelihood_free_rule.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["likelihood_free_rule"] = module
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


class OldCopyRule(EXAMPLE.AdvantageWeightedFM):  # type: ignore[misc, name-defined]
    """The example rule rolling out under a soft-updated "old" copy (DiffusionNFT's arrangement)."""

    name: ClassVar[str] = "awfm-old"

    def required_copies(self) -> frozenset[str]:
        return frozenset({"old"})

    def rollout_copy(self, step: int) -> str | None:
        return "old"


@hookimpl
def rlpost_register_optimizers(register: Any) -> None:
    register(OldCopyRule)


class _GradBackend(TrainBackend):
    """Backpropagates every loss and keeps the summed gradient at ``step`` (the weights never move)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.grads: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        self.grads = [p.grad.detach().clone() for p in self.params]
        for p in self.params:
            p.grad = None
        return {}


def test_gradient_equals_the_hand_written_loss():
    policy = ToyPolicy(scale=-0.7)
    policy.setup(torch.device("cpu"))
    rollout = sample_rollout(ToyChainSampler(num_steps=4), policy, groups=2, samples_per_group=3)
    adv = torch.linspace(-1.0, 1.0, rollout.num_samples)
    rule = EXAMPLE.AdvantageWeightedFM(timesteps=2, kl_beta=0.0)
    backend = _GradBackend(policy.trainable_parameters())
    gen = torch.Generator().manual_seed(0)
    edges = torch.zeros(rollout.num_edges)
    ctx = UpdateContext(policy, ToyChainSampler(4), rollout, Advantages(edges, adv), backend, gen, 3, seed=11)
    result = rule.update(ctx)
    assert result.train_forwards == rollout.num_samples * 2 and result.reference_forwards == 0

    # By hand: L = Σ_i Σ_j A_i · mean((a·x_ij + b_i - (ε_ij - x0_i))²) / (S·n), x_ij = (1-σ_ij)·x0_i + σ_ij·ε_ij.
    a = torch.tensor(-0.7, requires_grad=True)
    keys = sample_keys(rollout)
    levels = grid_permutations(11, 3, keys, 4, 2)
    bias = policy.encode(rollout.prompts).select(rollout.sample_group).tensors["bias"]
    total = torch.zeros((), dtype=torch.float64)
    for i, key in enumerate(keys):
        x0 = rollout.states[rollout.sample_node[i]].double()
        for j in range(2):
            sigma = float(rollout.sigmas[levels[i, j]])
            eps = noise_for(11, 3, key, tuple(x0.shape), j).double()
            x = (1 - sigma) * x0 + sigma * eps
            v = a.double() * x + float(bias[i])
            total = total + float(adv[i]) * ((v - (eps - x0)) ** 2).mean()
    (total / (rollout.num_samples * 2)).backward()
    assert a.grad is not None
    torch.testing.assert_close(backend.grads[0].double(), a.grad.double(), rtol=1e-5, atol=1e-7)


@pytest.fixture
def host():
    return build_host(load_entrypoints=False, extra_plugins=(toy_components, EXAMPLE, sys.modules[__name__]))


def _cfg(out: Path, steps: int) -> dict[str, Any]:
    cfg = toy_recipe(str(out), max_steps=steps)
    cfg["optimizer"] = {"class_path": "awfm-old", "init_args": {"timesteps": 2, "kl_beta": 0.0}}
    cfg["copies"] = {"old": {"rate": 0.2, "cap": 0.5}}
    cfg["checkpoint"] = {"every": 1, "keep_last": 0}
    return cfg


def test_validate_names_a_missing_copy(tmp_path, host):
    cfg = _cfg(tmp_path, 2)
    del cfg["copies"]
    with pytest.raises(Exception, match="optimizer 'awfm-old' needs a weight copy 'old'"):
        validate(cfg, host)


def test_run_under_a_copy_resumes_bitwise(tmp_path, host):
    full = Runner(validate(_cfg(tmp_path / "full", 4), host), host)
    history = full.run()
    assert [round(m["copies/old_decay"], 6) for m in history] == [0.2, 0.4, 0.5, 0.5]
    assert history[0]["perf/train_forwards"] == 2 * 8 and history[0]["perf/reference_forwards"] == 0
    part = Runner(validate(_cfg(tmp_path / "part", 4), host), host)
    part.begin()
    try:
        for _ in range(2):
            part.step()
            part.save_checkpoint()
    finally:
        part.finish("interrupted")
    resumed = Runner(validate(_cfg(tmp_path / "part", 4), host), host, resume="latest")
    resumed.run()
    assert full.copies is not None and resumed.copies is not None
    for x, y in zip(full.copies.shadows["old"], resumed.copies.shadows["old"], strict=True):
        assert torch.equal(x, y), "the old copy must be bitwise equal after resume"
    for x, y in zip(full.recipe.model.trainable_parameters(), resumed.recipe.model.trainable_parameters(), strict=True):
        assert torch.equal(x, y), "weights must be bitwise equal after resume"
    drop = ("perf/", "accelerate/")
    clean = [{k: v for k, v in m.items() if not k.startswith(drop)} for m in history]
    again = [{k: v for k, v in m.items() if not k.startswith(drop)} for m in resumed.ctx.history]
    assert clean == again


def test_rollouts_run_under_the_copy(tmp_path, host):
    """A copy frozen at the initial weights (d = 1 from the first update) makes every rollout the untrained policy's:
    the rewards equal those of a run whose weights barely move, and differ from a run rolling out the live weights."""

    def rewards(name: str, lr: float, rollout_copy: bool) -> list[float]:
        cfg = _cfg(tmp_path / name, 4)
        cfg["copies"] = {"old": {"rate": 1.0, "cap": 1.0}}
        cfg["torch_optimizer"]["init_args"]["lr"] = lr
        if not rollout_copy:
            cfg["optimizer"]["class_path"] = "awfm-example"
            del cfg["copies"]
        return [m["reward/weighted"] for m in Runner(validate(cfg, host), host).run()]

    frozen_old = rewards("old", 5.0, True)
    untrained = rewards("untrained", 1e-9, True)
    live = rewards("live", 5.0, False)
    assert frozen_old == pytest.approx(untrained, rel=1e-5, abs=1e-6)
    assert frozen_old[0] == pytest.approx(live[0], rel=1e-6)  # step 0: the copy is the live weights
    assert any(abs(x - y) > 1e-3 for x, y in zip(frozen_old[1:], live[1:], strict=True))
