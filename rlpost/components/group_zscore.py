"""Group-relative (GRPO) advantages for chain samplers: DanceGRPO, MixGRPO and Flow-GRPO-style runs.

Per prompt group ``g`` and sample ``j`` (``XueZeyue/DanceGRPO`` ``fastvideo/train_grpo_flux.py``@15cc71d;
``yifan123/flow_grpo`` ``flow_grpo/stat_tracking.py``@ac4c86e)::

    A_j = (R_j - mean_g(R)) / (std_g(R) + eps)          DanceGRPO: eps 1e-8, unbiased std (torch.std)
    A_j = (R_j - mean_g(R)) / (std_batch(R) + eps)      global_std (Flow-GRPO: std of all rewards, numpy ddof 0)

With several reward sources the order of mixing and normalising is a choice (``rlpost.ops.reward_mixing``):
``"advantage"`` z-scores each reward and sums them with their weights (MixGRPO's ``advantage_aggr``), ``"reward"``
z-scores the weighted sum of raw rewards (MixGRPO's ``reward_aggr``; identical to ``"advantage"`` for one reward).

A group whose rewards are all equal carries no signal: its advantages are exactly 0, also when the value is not
representable in float32 (``rlpost.ops.reward_mixing.group_zscore``; with several sources, a group in which every
source is constant). Flow-GRPO logs the fraction of such groups as ``zero_std_ratio``; here ``adv/zero_std_frac``
counts groups whose weighted reward sum is constant. Each sample's advantage is then given to every trainable edge of
its chain; non-trainable edges get 0.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost.components.chain import broadcast_to_edges
from rlpost.core.api import CHAINS, AdvantageEstimator, Advantages, Range
from rlpost.core.contract import RewardScores, Rollout
from rlpost.ops.reward_mixing import constant_groups, mix_rewards

__all__ = ["GroupZScoreAdvantage"]

MixMode = Literal["advantage", "reward"]


class GroupZScoreAdvantage(AdvantageEstimator):
    """Per-group z-scored rewards, broadcast to the trainable edges of each sample's chain.

    Args:
        eps: Added to the standard deviation (DanceGRPO 1e-8; Flow-GRPO 1e-4).
        global_std: Normalise by the std of all rewards of the step rather than the group's (Flow-GRPO's default).
        mix: How several rewards combine: ``"advantage"`` (z-score each, weighted sum; MixGRPO default) or
            ``"reward"`` (weighted raw sum, then z-score).
    """

    name: ClassVar[str] = "group-zscore"
    requires: ClassVar[frozenset[str]] = frozenset({CHAINS})

    def __init__(
        self, eps: Annotated[float, Range(gt=0)] = 1e-8, global_std: bool = False, mix: MixMode = "advantage"
    ) -> None:
        self.eps = float(eps)
        self.global_std = bool(global_std)
        self.mix = mix

    def validate(self, recipe: Any) -> list[str]:
        """Check ``mix`` (``eps``'s range is declared on the argument) and that groups have two samples or more."""
        problems = []
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
        scores = RewardScores({k: v.cpu() for k, v in scores.scores.items()}, scores.weights)
        # The shared z-score gives exact zeros for constant groups (of each source in "advantage" mode).
        adv = mix_rewards(scores, groups, self.mix, self.eps, global_std=self.global_std)
        flat = constant_groups(scores.weighted_sum(), groups)
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
