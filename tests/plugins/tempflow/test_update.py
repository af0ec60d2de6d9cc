"""The noise-weighted surrogate and the KL against a restatement of TempFlow-GRPO's loss (arXiv 2508.04324, Sec. 3.2;
upstream ``train_sd3_pr.py``'s ``2.25·std_dev_t`` factor and ``/(2·std_dev_t²)`` KL) on a tiny batch."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

from rlpost.core.api import Advantages, EdgeEval, UpdateContext
from rlpost.core.contract import Rollout
from rlpost_tempflow.update import TempFlowUpdate

SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.0])


class Policy:
    def __init__(self) -> None:
        self.ref = False

    def train(self, mode: bool = True) -> None:
        pass

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        self.ref = True
        yield
        self.ref = False


class Sampler:
    """Edges with given new log-probs, means and per-edge stds; the reference returns other means."""

    def __init__(self, policy: Policy, theta: torch.nn.Parameter, logp, mean, ref_mean, std) -> None:
        self.policy, self.theta = policy, theta
        self.logp, self.mean, self.ref_mean, self.std = logp, mean, ref_mean, std

    def evaluate(self, policy, rollout, edges):
        mean = (self.ref_mean if self.policy.ref else self.mean)[edges] + 0 * self.theta
        return EdgeEval(self.logp[edges] + 0 * self.theta, mean, self.std[edges], forwards=1)


class Backend:
    world_size = 1

    def __init__(self) -> None:
        self.losses: list[float] = []

    def backward(self, loss):
        self.losses.append(float(loss))

    def step(self):
        return {"train/grad_norm": 0.0, "train/lr": 1.0}


def rollout(old: torch.Tensor, parent_step: list[int]) -> Rollout:
    e = old.numel()
    return Rollout(
        prompts=["p"],
        metadata=[{}],
        sigmas=SIGMAS,
        states=torch.zeros(2 * e, 1),
        node_step=torch.tensor(parent_step + [s + 1 for s in parent_step]),
        node_group=torch.zeros(2 * e, dtype=torch.long),
        edge_parent=torch.arange(e),
        edge_child=torch.arange(e, 2 * e),
        old_log_probs=old,
        trainable=torch.ones(e, dtype=torch.bool),
        edge_kernel=torch.zeros(e, dtype=torch.long),
        kernels=["flow-sde"],
        sample_node=torch.arange(e, 2 * e),
        sample_group=torch.zeros(e, dtype=torch.long),
        media=torch.zeros(e, 1, 1, 1, 3, dtype=torch.uint8),
    )


@pytest.mark.parametrize("noise_std", ["step", "diffusion"])
def test_loss_matches_the_papers_weighting(noise_std: str) -> None:
    a = 0.7
    steps = [0, 1, 2]
    # S_j = a·sqrt(σ/(1-σ))·sqrt(-dt); at σ = 1 the denominator uses σ_1 (Flow-GRPO's sigma_max).
    s_diff, s_step = [], []
    for j in steps:
        sig, nxt = float(SIGMAS[j]), float(SIGMAS[j + 1])
        denom = float(SIGMAS[1]) if sig >= 1 else sig
        sd = a * math.sqrt(sig / (1 - denom))
        s_diff.append(sd)
        s_step.append(sd * math.sqrt(sig - nxt))
    std = torch.tensor(s_step).view(3, 1, 1)
    old = torch.tensor([0.0, 0.1, -0.2], dtype=torch.float64)
    new = old + torch.tensor([math.log(1.3), math.log(0.9), 0.0], dtype=torch.float64)
    adv = torch.tensor([2.0, -7.0, 0.5])
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 2, 2, generator=gen)
    ref_mean = mean + 0.05 * torch.randn(3, 2, 2, generator=gen)
    policy, theta = Policy(), torch.nn.Parameter(torch.zeros(()))
    beta, eps = 0.01, 0.2
    rule = TempFlowUpdate(clip_range=eps, kl_coef=beta, optimizer_steps=1, noise_std=noise_std)  # type: ignore[arg-type]
    backend = Backend()
    ctx = UpdateContext(
        policy,
        Sampler(policy, theta, new, mean, ref_mean, std),
        rollout(old, steps),
        Advantages(edges=adv, samples=adv),
        backend,
        torch.Generator().manual_seed(0),
        0,
    )  # type: ignore[arg-type]
    rule.update(ctx)
    scale = s_step if noise_std == "step" else s_diff
    total = 0.0
    for j in range(3):
        r = math.exp(float(new[j] - old[j]))
        A = max(-5.0, min(5.0, float(adv[j])))
        surrogate = max(-A * r, -A * min(max(r, 1 - eps), 1 + eps))
        kl = float(((mean[j] - ref_mean[j]) ** 2).mean()) / (2 * scale[j] ** 2)
        total += 2.25 * scale[j] * surrogate + beta * kl
    assert backend.losses == [pytest.approx(total / 3, rel=1e-6)]


def test_defaults_follow_the_pickscore_preset() -> None:
    rule = TempFlowUpdate()
    assert rule.weight_scale == 2.25 and rule.kl_coef == 0.001 and rule.adv_clip_max == 5.0
    assert rule.clip_range == 1e-4 and rule.optimizer_steps == 2 and rule.inner_epochs == 1
