"""The flow-grpo update rule and advantages against independent computations on a tiny batch: the clipped surrogate
with Flow-GRPO's KL over 2·s_t² (s_t = a·sqrt(σ/(1-σ)), no sqrt(-dt)), GRPO-Guard's ratio normalisation (one bias per
step group, or per sample) and the per-prompt advantages of upstream's PerPromptStatTracker; validation refuses
Guard without recorded means."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from rlpost import EDGE_OLD_MEANS, Advantages, EdgeEval, RewardScores, Rollout, UpdateContext
from rlpost.apps.host import build_host
from rlpost.engine.recipe import RecipeError, validate
from rlpost_flowgrpo.advantage import FlowGRPOAdvantage
from rlpost_flowgrpo.update import FlowGRPOUpdate

ROOT = Path(__file__).resolve().parents[3]
A = 0.7
SIGMAS = torch.tensor([1.0, 0.8, 0.5, 0.0])
# Two chains of three edges (steps 0, 1, 2); edge e = chain·3 + step.
STEPS = torch.tensor([0, 1, 2, 0, 1, 2])


def _rollout(old_means: torch.Tensor | None = None) -> Rollout:
    node_step = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    parent = torch.tensor([0, 1, 2, 4, 5, 6])
    return Rollout(
        prompts=["p"],
        metadata=[{}],
        sigmas=SIGMAS,
        states=torch.zeros(8, 2, 2),
        node_step=node_step,
        node_group=torch.zeros(8, dtype=torch.long),
        edge_parent=parent,
        edge_child=parent + 1,
        old_log_probs=torch.tensor([0.1, -0.2, 0.3, 0.0, 0.2, -0.1], dtype=torch.float64),
        trainable=torch.ones(6, dtype=torch.bool),
        edge_kernel=torch.zeros(6, dtype=torch.long),
        kernels=["flow-sde"],
        sample_node=torch.tensor([3, 7]),
        sample_group=torch.zeros(2, dtype=torch.long),
        media=torch.zeros(2, 1, 1, 1, 3, dtype=torch.uint8),
        edge_extras={} if old_means is None else {EDGE_OLD_MEANS: old_means},
    )


def _s_t(step: int) -> float:
    """Flow-GRPO's std_dev_t (arXiv 2505.05470 eq. 9; σ = 1 uses σ_1 in 1 - σ)."""
    s = float(SIGMAS[step])
    return A * math.sqrt(s / (1 - (float(SIGMAS[1]) if s == 1.0 else s)))


def _neg_dt(step: int) -> float:
    return float(SIGMAS[step] - SIGMAS[step + 1])


GEN = torch.Generator().manual_seed(0)
NEW_LOGP = torch.tensor([0.1003, -0.2001, 0.2996, 0.0002, 0.2, -0.1004], dtype=torch.float64)
MEAN = torch.randn(6, 2, 2, generator=GEN)
REF_MEAN = MEAN + 0.05 * torch.randn(6, 2, 2, generator=GEN)
OLD_MEAN = MEAN + 0.01 * torch.randn(6, 2, 2, generator=GEN)
ADV = torch.tensor([1.0, 1.0, 1.0, -7.0, -7.0, -7.0])


class FixedSampler:
    """Returns given log-probs and means (a differentiable function of ``theta``) and the step std s_t·sqrt(-dt);
    inside ``policy.reference()`` the reference means."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.theta = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))

    def evaluate(self, policy: Any, rollout: Rollout, edges: torch.Tensor) -> EdgeEval:
        std = torch.tensor([_s_t(int(STEPS[e])) * math.sqrt(_neg_dt(int(STEPS[e]))) for e in edges])
        mean = (REF_MEAN if self.policy.in_reference else MEAN)[edges] + 0 * self.theta.float()
        return EdgeEval(NEW_LOGP[edges] + 0 * self.theta, mean, std.reshape(-1, 1, 1), forwards=len(edges))


class Policy:
    in_reference = False

    def train(self, mode: bool = True) -> None:
        pass

    @contextmanager
    def reference(self):  # type: ignore[no-untyped-def]
        self.in_reference = True
        try:
            yield
        finally:
            self.in_reference = False


class Backend:
    world_size = 1

    def __init__(self) -> None:
        self.losses: list[float] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss))

    def step(self) -> dict[str, float]:
        return {"train/grad_norm": 0.0, "train/lr": 1.0}


def _update(rule: FlowGRPOUpdate, rollout: Rollout) -> tuple[list[float], dict[str, float]]:
    policy, backend = Policy(), Backend()
    ctx = UpdateContext(
        policy,  # type: ignore[arg-type]
        FixedSampler(policy),  # type: ignore[arg-type]
        rollout,
        Advantages(edges=ADV, samples=ADV[[0, 3]]),
        backend,  # type: ignore[arg-type]
        torch.Generator().manual_seed(0),
        0,
    )
    result = rule.update(ctx)
    return backend.losses, result.metrics


def _clipped(adv: float, ratio: float, eps: float) -> float:
    adv = max(-5.0, min(5.0, adv))
    return max(-adv * ratio, -adv * min(max(ratio, 1 - eps), 1 + eps))


def test_policy_loss_and_kl_over_two_s_t_squared() -> None:
    eps, beta = 2e-4, 0.01
    rule = FlowGRPOUpdate(clip_range=eps, kl_coef=beta, optimizer_steps=1, minibatch_edges=64)
    losses, metrics = _update(rule, _rollout())
    policy = [
        _clipped(float(ADV[e]), math.exp(float(NEW_LOGP[e] - _rollout().old_log_probs[e])), eps) for e in range(6)
    ]
    kl = [float(((MEAN[e] - REF_MEAN[e]) ** 2).mean()) / (2 * _s_t(int(STEPS[e])) ** 2) for e in range(6)]
    assert losses == [pytest.approx(sum(policy) / 6 + beta * sum(kl) / 6, rel=1e-6)]
    assert metrics["loss/kl"] == pytest.approx(sum(kl) / 6, rel=1e-5)
    ratios = np.exp((NEW_LOGP - _rollout().old_log_probs).numpy())
    assert metrics["train/clipfrac_gt_one"] == pytest.approx(float((ratios - 1 > eps).mean()))
    assert metrics["train/clipfrac_lt_one"] == pytest.approx(float((1 - ratios > eps).mean()))


@pytest.mark.parametrize("bias_mode", ["batch", "sample"])
def test_grpo_guard_ratio_normalisation(bias_mode: str) -> None:
    """scripts/train_sd3_GRPO_Guard.py L915-932 on micro-batches of one timestep: d̄ = sqrt(-dt), s̄ = s_t,
    bias = mean((μ_θ - μ_old)²) over the step's samples and elements / (2 (d̄ s̄)²), ratio = exp((Δ + bias)·d̄ s̄),
    policy loss / d̄²; ``sample``: each sample's own mean."""
    eps = 1e-3
    rule = FlowGRPOUpdate(clip_range=eps, optimizer_steps=1, ratio_norm=True, ratio_norm_bias=bias_mode)
    rollout = _rollout(OLD_MEAN)
    losses, _ = _update(rule, rollout)
    total = 0.0
    for step in range(3):
        edges = [e for e in range(6) if int(STEPS[e]) == step]
        d, s = math.sqrt(_neg_dt(step)), _s_t(step)
        per = [float(((MEAN[e] - OLD_MEAN[e]) ** 2).mean()) for e in edges]
        for e, sq in zip(edges, per, strict=True):
            bias = (sum(per) / len(per) if bias_mode == "batch" else sq) / (2 * (d * s) ** 2)
            ratio = math.exp((float(NEW_LOGP[e] - rollout.old_log_probs[e]) + bias) * d * s)
            total += _clipped(float(ADV[e]), ratio, eps) / d**2
    assert losses == [pytest.approx(total / 6, rel=1e-6)]


def test_guard_ratio_is_one_when_nothing_changed() -> None:
    """μ_θ = μ_old and log π_θ = log π_old: bias 0 and ratio exactly 1, before any update."""
    rule = FlowGRPOUpdate(optimizer_steps=1, ratio_norm=True)
    rollout = _rollout(MEAN.clone())
    rollout.old_log_probs = NEW_LOGP.clone()
    _, metrics = _update(rule, rollout)
    assert metrics["train/first_ratio_dev"] == 0.0


def test_guard_without_recorded_means_fails_clearly() -> None:
    rule = FlowGRPOUpdate(optimizer_steps=1, ratio_norm=True)
    with pytest.raises(ValueError, match="record_old_means"):
        _update(rule, _rollout())


def _tracker(prompts: list[str], rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """Upstream's PerPromptStatTracker.update (flow_grpo/stat_tracking.py L11-32), restated with numpy."""
    prompts_arr, out = np.array(prompts), np.empty_like(rewards)
    for p in np.unique(prompts_arr):
        mine = rewards[prompts_arr == p]
        std = (np.std(rewards) if global_std else np.std(mine)) + 1e-4
        out[prompts_arr == p] = (mine - np.mean(mine)) / std
    return out


@pytest.mark.parametrize("global_std", [True, False])
def test_advantages_match_upstream_tracker(global_std: bool) -> None:
    # Three groups; groups 0 and 2 drew the same prompt text (upstream merges them).
    prompts = ["a cat", "a dog", "a cat"]
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    rewards = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.9, 0.9, 0.2, 0.8, 0.4])
    nodes = torch.arange(9)
    rollout = Rollout(
        prompts=prompts,
        metadata=[{}, {}, {}],
        sigmas=torch.tensor([1.0, 0.0]),
        states=torch.zeros(18, 1),
        node_step=torch.cat([torch.zeros(9, dtype=torch.long), torch.ones(9, dtype=torch.long)]),
        node_group=torch.cat([groups, groups]),
        edge_parent=nodes,
        edge_child=nodes + 9,
        old_log_probs=torch.zeros(9, dtype=torch.float64),
        trainable=torch.ones(9, dtype=torch.bool),
        edge_kernel=torch.zeros(9, dtype=torch.long),
        kernels=["flow-sde"],
        sample_node=nodes + 9,
        sample_group=groups,
        media=torch.zeros(9, 1, 1, 1, 3, dtype=torch.uint8),
    )
    scores = RewardScores({"r": rewards}, {"r": 1.0})
    adv = FlowGRPOAdvantage(global_std=global_std).estimate(rollout, scores)
    expected = _tracker([prompts[g] for g in groups.tolist()], rewards.double().numpy(), global_std)
    np.testing.assert_allclose(adv.samples.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv.edges.numpy(), expected, rtol=1e-5, atol=1e-6)  # each chain's edge
    assert adv.metrics["adv/zero_std_frac"] == pytest.approx(0.5)  # "a dog" is constant; "a cat" is not


def test_validate_refuses_guard_without_recorded_means() -> None:
    cfg = yaml.safe_load((ROOT / "recipes/tiny/grpo_guard_sd3.yaml").read_text())
    host = build_host()
    validate(cfg, host)
    cfg["sampler"]["init_args"]["record_old_means"] = False
    with pytest.raises(RecipeError, match=EDGE_OLD_MEANS):
        validate(cfg, host)
    cfg["sampler"]["init_args"].update(record_old_means=True, kernel="cps", noise_level=0.8)
    with pytest.raises(RecipeError, match="ratio_norm"):
        validate(cfg, host)
