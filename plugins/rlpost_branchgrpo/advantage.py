"""BranchGRPO advantages: rewards fused up each tree, then z-scored per depth within the tree.

BranchGRPO (Li et al., arXiv 2509.06040, Sec. 3.3; ``Fredreic1849/BranchGRPO``
``fastvideo/train_branchgrpo_flux.py``@19fbb9f):

1. Reward fusion (``compute_node_rewards_from_leaves``, L545-652): a leaf's reward is its score; an inner node's
   reward is the mean over its descendant leaves, or with ``tree_prob_weighted`` the softmax-weighted sum over its
   children ``R(u) = Σ_c softmax_c(α·log π_old(u→c))·R(c)`` with ``α = 1`` (single children pass their reward up).
2. Per-depth normalisation (``compute_hierarchical_advantages_by_depth``, L655-687), per tree: the nodes at one depth
   get ``(R - mean)/(std + 1e-8)`` with the unbiased std; all zero when ``std < 1e-6`` or the depth holds one node
   (the root).
3. Every edge ``parent → child`` carries the **child's** advantage (``collect_all_transitions``, L1199-1225);
   non-trainable edges get 0 here.

``use_group`` (upstream ``--use_group``, L1042-1132) replaces 1-2 by per-prompt leaf z-scores (eps 1e-8, unbiased
std). Upstream assigns them to leaves only and leaves every inner node's advantage ``None``, which its training loop
cannot read (``adv.dim()`` on ``None``); here an inner node carries the same fusion of its leaves' z-scores (the
mean, or the softmax weighting), so chain edges after the last split carry their leaf's z-score exactly.

A tree is the set of nodes below one root (``node_step == 0``), found from the edge table, so several trees per prompt
would be normalised separately, as upstream normalises each root's tree (L1147-1190).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import torch
from torch import Tensor

from rlpost import (
    TREE,
    AdvantageEstimator,
    Advantages,
    Range,
    RewardScores,
    Rollout,
    backup_values,
    descendant_leaf_totals,
    edge_levels,
    mix_rewards,
)

__all__ = ["BranchFusionAdvantage", "depth_zscores", "fuse_rewards", "node_roots"]


def node_roots(rollout: Rollout) -> Tensor:
    """``[N]`` root node of every node's tree (edges processed from the shallowest level down)."""
    roots = torch.arange(rollout.num_nodes)
    for _, e in reversed(edge_levels(rollout)):
        roots[rollout.edge_child[e]] = roots[rollout.edge_parent[e]]
    return roots


def fuse_rewards(rollout: Rollout, leaf_values: Tensor, prob_weighted: bool, alpha: float = 1.0) -> Tensor:
    """``[N]`` float64 fused value of every node (NaN for nodes below which no sample was decoded).

    ``prob_weighted=False``: mean over the node's descendant leaves (upstream L636-643); ``True``: softmax of
    ``α·log π_old`` over the node's child edges, applied level by level (L606-633; temperature ``1/α``).
    """
    if prob_weighted:
        values, _ = backup_values(rollout, leaf_values, "softmax", temperature=1.0 / alpha)
        return values
    total, count = descendant_leaf_totals(rollout, leaf_values)
    return torch.where(count > 0, total / count.clamp_min(1.0), torch.full_like(total, float("nan")))


def depth_zscores(rollout: Rollout, values: Tensor, std_floor: float = 1e-6, eps: float = 1e-8) -> Tensor:
    """``[N]`` float64 per-(tree, depth) z-scores of ``values`` (NaN values ignored, their z-score 0).

    Unbiased std; a (tree, depth) set with one node, or with ``std < std_floor``, gets 0 (upstream L664-681).
    """
    roots = node_roots(rollout)
    key = roots * (int(rollout.node_step.max()) + 1) + rollout.node_step
    out = torch.zeros(rollout.num_nodes, dtype=torch.float64)
    valid = ~torch.isnan(values)
    uniq, inverse = torch.unique(key[valid], return_inverse=True)
    v = values[valid]
    m = int(uniq.numel())
    n = torch.zeros(m, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(v))
    mean = torch.zeros(m, dtype=torch.float64).index_add_(0, inverse, v) / n
    sq = torch.zeros(m, dtype=torch.float64).index_add_(0, inverse, (v - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp_min(1.0))
    z = (v - mean[inverse]) / (std[inverse] + eps)
    zero = (n[inverse] < 2) | (std[inverse] < std_floor)
    out[valid] = torch.where(zero, torch.zeros_like(z), z)
    return out


class BranchFusionAdvantage(AdvantageEstimator):
    """BranchGRPO's fused rewards with per-depth normalisation; each edge carries its child's advantage.

    Args:
        tree_prob_weighted: Fuse inner-node rewards by ``softmax(α·log π_old(child edge))`` instead of the mean over
            descendant leaves (upstream ``--tree_prob_weighted``; off in the launch script).
        alpha: ``α`` of the weighting (upstream fixes 1.0).
        use_group: Per-prompt leaf z-scores fused up the tree instead of per-depth normalisation (upstream
            ``--use_group``; see the module docstring for the inner nodes).
        std_floor: Per-depth sets with a smaller std get advantage 0 (upstream 1e-6).
        eps: Added to each std (upstream 1e-8 for both normalisations).
    """

    name: ClassVar[str] = "branch-fusion"
    requires: ClassVar[frozenset[str]] = frozenset({TREE})

    def __init__(
        self,
        tree_prob_weighted: bool = False,
        alpha: Annotated[float, Range(gt=0)] = 1.0,
        use_group: bool = False,
        std_floor: Annotated[float, Range(ge=0)] = 1e-6,
        eps: Annotated[float, Range(ge=0)] = 1e-8,
    ) -> None:
        self.tree_prob_weighted = bool(tree_prob_weighted)
        self.alpha = float(alpha)
        self.use_group = bool(use_group)
        self.std_floor = float(std_floor)
        self.eps = float(eps)

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Fused node rewards, per-depth z-scores (or fused group z-scores), child advantage on each trainable edge.

        Several reward sources are summed with their recipe weights before fusion (upstream scores one reward)."""
        reward = scores.weighted_sum().double().cpu()
        if self.use_group:
            groups = rollout.sample_group + rollout.group_offset
            leaf = mix_rewards(scores, groups, mode="reward", eps=self.eps).double().cpu()
            node = fuse_rewards(rollout, leaf, self.tree_prob_weighted, self.alpha).nan_to_num(0.0)
        else:
            fused = fuse_rewards(rollout, reward, self.tree_prob_weighted, self.alpha)
            node = depth_zscores(rollout, fused, self.std_floor, self.eps)
            leaf = node[rollout.sample_node]
        edges = node[rollout.edge_child]
        edges = torch.where(rollout.trainable, edges, torch.zeros_like(edges)).float()
        train = rollout.trainable
        metrics = {
            "adv/abs_mean": float(edges[train].abs().mean()) if bool(train.any()) else 0.0,
            "adv/leaf_std": float(leaf.std()) if leaf.numel() > 1 else 0.0,
            "adv/zero_frac": float((edges[train] == 0).double().mean()) if bool(train.any()) else 0.0,
            "reward/tree_mean": float(reward.mean()),
        }
        return Advantages(edges=edges, samples=leaf.float(), metrics=metrics)
