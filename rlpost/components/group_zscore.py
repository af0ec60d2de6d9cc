"""Group-relative (GRPO) advantages for chain samplers: DanceGRPO, MixGRPO and Flow-GRPO-style runs.

Per prompt group ``g`` and sample ``j`` (algorithms.md 1.4)::

    A_j = (R_j - mean_g(R)) / (std_g(R) + eps)          DanceGRPO: eps 1e-8, unbiased std (torch.std)
    A_j = (R_j - mean_g(R)) / (std_batch(R) + eps)      global_std (Flow-GRPO: std of all rewards, numpy ddof 0)

With several reward sources the order of mixing and normalising is a choice (``rlpost.ops.reward_mixing``):
``"advantage"`` z-scores each reward and sums them with their weights (MixGRPO's ``advantage_aggr``), ``"reward"``
z-scores the weighted sum of raw rewards (MixGRPO's ``reward_aggr``; identical to ``"advantage"`` for one reward).

A group whose (weighted) rewards are all equal carries no signal: its advantages are set to exactly 0 (Flow-GRPO
logs the fraction of such groups as ``zero_std_ratio``; here ``adv/zero_std_frac``). Each sample's advantage is then
given to every trainable edge of its chain; non-trainable edges get 0.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost.api import AdvantageEstimator, Advantages
from rlpost.components.chain import broadcast_to_edges
from rlpost.contract import RewardScores, Rollout
from rlpost.ops.reward_mixing import group_zscore

__all__ = ["GroupZScoreAdvantage", "constant_groups", "zscore"]

MixMode = Literal["advantage", "reward"]


def constant_groups(values: Tensor, groups: Tensor) -> Tensor:
    """``[S]`` bool, True for samples whose group's ``values`` are all equal (zero spread)."""
    _, inverse = torch.unique(groups, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    v = values.float()
    hi = torch.full((n,), -torch.inf).scatter_reduce(0, inverse, v, reduce="amax")
    lo = torch.full((n,), torch.inf).scatter_reduce(0, inverse, v, reduce="amin")
    return (hi == lo)[inverse]


def zscore(values: Tensor, groups: Tensor, eps: float, global_std: bool) -> Tensor:
    """Group z-score with exact zeros for constant groups.

    Args:
        values: ``[S]`` rewards.
        groups: ``[S]`` group ids.
        eps: Added to the standard deviation.
        global_std: Divide by the (ddof 0) std of the whole batch instead of the group's (unbiased) std.
    """
    v = values.float()
    if global_std:
        _, inverse = torch.unique(groups, return_inverse=True)
        n = int(inverse.max()) + 1
        mean = torch.zeros(n).index_add_(0, inverse, v) / torch.bincount(inverse, minlength=n).float()
        out = (v - mean[inverse]) / (v.std(unbiased=False) + eps)
    else:
        out = group_zscore(v, groups, eps=eps, unbiased=True)
    return torch.where(constant_groups(v, groups), torch.zeros_like(out), out)


class GroupZScoreAdvantage(AdvantageEstimator):
    """Per-group z-scored rewards, broadcast to the trainable edges of each sample's chain.

    Args:
        eps: Added to the standard deviation (DanceGRPO 1e-8; Flow-GRPO 1e-4).
        global_std: Normalise by the std of all rewards of the step rather than the group's (Flow-GRPO's default).
        mix: How several rewards combine: ``"advantage"`` (z-score each, weighted sum; MixGRPO default) or
            ``"reward"`` (weighted raw sum, then z-score).
    """

    name: ClassVar[str] = "group-zscore"
    requires: ClassVar[frozenset[str]] = frozenset({"chains"})

    def __init__(self, eps: float = 1e-8, global_std: bool = False, mix: MixMode = "advantage") -> None:
        self.eps = float(eps)
        self.global_std = bool(global_std)
        self.mix = mix

    def validate(self, recipe: Any) -> list[str]:
        """Check ``eps`` and ``mix``, and warn-level problems with group sizes of one."""
        problems = []
        if not self.eps > 0:
            problems.append(f"advantage.init_args.eps: must be > 0, got {self.eps}")
        if self.mix not in ("advantage", "reward"):
            problems.append(f"advantage.init_args.mix: must be 'advantage' or 'reward', got {self.mix!r}")
        if recipe.run.samples_per_group < 2:
            problems.append(
                f"run.samples_per_group: group-zscore needs at least 2 samples per group, got "
                f"{recipe.run.samples_per_group} (every advantage would be 0)"
            )
        return problems

    def sample_advantages(self, scores: RewardScores, groups: Tensor) -> tuple[Tensor, float]:
        """``[S]`` per-sample advantages and the fraction of groups with zero reward spread."""
        groups = groups.long().cpu()
        total = scores.weighted_sum().cpu()
        if self.mix == "reward":
            adv = zscore(total, groups, self.eps, self.global_std)
        else:
            # Same order as rlpost.ops.reward_mixing.mix_rewards(mode="advantage"), with exact zeros for
            # constant groups of each source and the optional global std.
            adv = torch.zeros_like(total)
            for name, value in scores.scores.items():
                adv = adv + scores.weights[name] * zscore(value.cpu(), groups, self.eps, self.global_std)
        flat = constant_groups(total, groups)
        adv = torch.where(flat, torch.zeros_like(adv), adv)
        _, first = torch.unique(groups, return_inverse=True)
        n = int(first.max()) + 1
        per_group = torch.zeros(n, dtype=torch.bool).scatter_(0, first, flat)
        return adv, float(per_group.float().mean())

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Z-score rewards per prompt group and give each trainable edge its sample's advantage."""
        adv, zero_frac = self.sample_advantages(scores, rollout.sample_group)
        edges = broadcast_to_edges(rollout, adv)
        trained = edges[rollout.trainable]
        metrics = {
            "adv/zero_std_frac": zero_frac,
            "adv/abs_mean": float(adv.abs().mean()),
            "adv/max": float(adv.max()),
            "adv/min": float(adv.min()),
            "adv/trainable_edges": float(trained.numel()),
        }
        return Advantages(edges=edges, samples=adv, metrics=metrics)
