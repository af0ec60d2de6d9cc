"""TreeGRPO advantages: per-prompt leaf z-scores backed up leaf → root with softmax(log π_old) weights.

TreeGRPO (Ding & Ye, arXiv 2512.08153, Sec. "Method"):

1. Leaf advantage ``A(ℓ)``: the leaf's reward z-scored within its prompt's leaves (all trees of that prompt).
   Several rewards are mixed by :func:`rlpost.ops.reward_mixing.mix_rewards`; the paper's 0.8 HPS : 0.2 CLIP mix is
   on advantages (``multi_reward: advantage``).
2. Backup in reverse topological order: the value of node ``u`` is ``V(u) = Σ_{e ∈ S(u)} w_u(e) · V(child(e))``
   with ``w_u(e) = softmax_{e ∈ S(u)}(log π_old(e) / τ)``; a decoded sample's value is its leaf advantage.
3. The advantage of edge ``e`` is ``V(child(e))``: a leaf edge gets its leaf's advantage, a window edge the
   probability-weighted average of its children's edge advantages. Single-child (ODE) nodes have weight 1 and pass
   values through unchanged. Non-trainable edges get advantage 0.

Everything is vectorised per schedule level (one ``index_add`` per step, never a Python loop over nodes): edges
always go from step ``t`` to a later step, so processing parents by decreasing ``node_step`` is a topological order.

Beyond the paper, ``weights: calibrated`` keeps the softmax's ordering but picks the temperature per node so the
weights' effective sample size ``1/Σw²`` is a chosen fraction of the node's children (:func:`calibrated_weights`;
``docs/algorithms/treegrpo.md``, "Beyond the paper"): with per-element-mean log-probs the paper's weights are uniform,
with per-element sums nearly one-hot, so the temperature that makes the weighting matter depends on the log-prob scale.

The ``leaf-zscore`` ablation keeps the same leaf z-scores but replaces the policy-weighted backup by plain
aggregation over each edge's descendant leaves (see :class:`LeafZScoreAdvantage`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import (
    TREE,
    AdvantageEstimator,
    Advantages,
    Range,
    RewardScores,
    Rollout,
    Weighting,
    backup_values,
    constant_groups,
    descendant_leaf_totals,
    mix_rewards,
)

__all__ = ["LeafZScoreAdvantage", "TreeBackupAdvantage", "zero_std_fraction"]


def zero_std_fraction(values: Tensor, groups: Tensor) -> float:
    """Fraction of groups whose ``values`` are all equal (their leaf z-scores are exactly zero)."""
    if values.numel() == 0:
        return 0.0
    _, inverse = torch.unique(groups, return_inverse=True)
    flat = constant_groups(values, groups)
    per_group = torch.zeros(int(inverse.max()) + 1, dtype=torch.bool).scatter_(0, inverse, flat)
    return float(per_group.double().mean())


def _leaf_advantages(
    rollout: Rollout, scores: RewardScores, mode: Literal["advantage", "reward"], eps: float, unbiased: bool = True
) -> Tensor:
    """Per-prompt z-scored (unbiased std) and mixed leaf advantages, ``[S]`` fp32; exactly 0 for a prompt whose
    leaves all score the same (the shared z-score's guarantee), so the backup of such a prompt is 0 too."""
    groups = rollout.sample_group + rollout.group_offset
    return mix_rewards(scores, groups, mode=mode, eps=eps, unbiased=unbiased).float()


def _common_metrics(rollout: Rollout, scores: RewardScores, leaf: Tensor, edges: Tensor) -> dict[str, float]:
    train = rollout.trainable
    return {
        "adv/abs_mean": float(edges[train].abs().mean()) if bool(train.any()) else 0.0,
        "adv/leaf_std": float(leaf.std()) if leaf.numel() > 1 else 0.0,
        "adv/zero_std_frac": zero_std_fraction(scores.weighted_sum(), rollout.sample_group),
    }


class TreeBackupAdvantage(AdvantageEstimator):
    """TreeGRPO's leaf-to-root advantage backup (arXiv 2512.08153, Sec. "Method").

    Args:
        temperature: ``τ`` in ``w_u(e) = softmax(log π_old(e) / τ)``. The log-prob scale is the sampler's
            ``logprob_reduction``: per-element means give near-uniform weights, sums near one-hot ones (§2.6).
        weights: ``"softmax"`` (the paper), ``"uniform"`` (ablation: plain mean over children) or
            ``"calibrated"`` (beyond the paper: softmax with a per-node temperature that sets the weights' effective
            sample size to ``target_ess`` of the children; ``temperature`` is then unused).
        target_ess: ``weights: calibrated`` only: target ``1/Σw²`` as a fraction of each node's child count, in
            ``[0, 1]``; ``1`` = uniform, ``≤ 1/k`` = one-hot on the most probable child.
        multi_reward: ``"advantage"``: weighted sum of per-reward leaf z-scores (the paper's 0.8 HPS : 0.2 CLIP);
            ``"reward"``: z-score of the weighted reward sum.
        eps: Added to each prompt's leaf std.
        std: ``"unbiased"`` (Bessel-corrected, as ``torch.std`` and DanceGRPO; the default) or ``"population"``
            (``n`` in the denominator, as the official TreeGRPO code's leaf normalisation; the ``treegrpo-code``
            presets use it). With 27 leaves the two differ by a factor ``sqrt(27/26)``, i.e. 1.9 %.
    """

    name: ClassVar[str] = "tree-backup"
    requires: ClassVar[frozenset[str]] = frozenset({TREE})

    def __init__(
        self,
        temperature: Annotated[float, Range(gt=0)] = 1.0,
        weights: Weighting = "softmax",
        multi_reward: Literal["advantage", "reward"] = "advantage",
        eps: Annotated[float, Range(ge=0)] = 1e-8,
        std: Literal["unbiased", "population"] = "unbiased",
        target_ess: Annotated[float, Range(ge=0, le=1)] = 0.5,
    ) -> None:
        self.temperature = float(temperature)
        self.weights: Weighting = weights
        self.target_ess = float(target_ess)
        self.multi_reward: Literal["advantage", "reward"] = multi_reward
        self.eps = float(eps)
        self.std: Literal["unbiased", "population"] = std

    def validate(self, recipe: object) -> list[str]:
        """Check ``weights`` and ``std`` (the numeric ranges are declared on the arguments)."""
        problems = []
        if self.weights not in ("softmax", "uniform", "calibrated"):
            problems.append(
                f"advantage.init_args.weights: must be 'softmax', 'uniform' or 'calibrated', got {self.weights!r}"
            )
        if self.std not in ("unbiased", "population"):
            problems.append(f"advantage.init_args.std: must be 'unbiased' or 'population', got {self.std!r}")
        return problems

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Leaf z-scores, then the probability-weighted backup; advantage 0 on non-trainable edges."""
        leaf = _leaf_advantages(rollout, scores, self.multi_reward, self.eps, unbiased=self.std == "unbiased")
        values, edge_w = backup_values(rollout, leaf, self.weights, self.temperature, self.target_ess)
        edges = values[rollout.edge_child].nan_to_num(0.0)
        edges = torch.where(rollout.trainable, edges, torch.zeros_like(edges)).float()
        metrics = _common_metrics(rollout, scores, leaf, edges)
        # ESS of each branching node's weights, 1/Σw² (k for uniform weights, 1 for one-hot), averaged over nodes.
        branching = rollout.children_count() > 1
        sq = torch.zeros(rollout.num_nodes, dtype=torch.float64).index_add_(0, rollout.edge_parent, edge_w**2)
        metrics["adv/backup_ess"] = float((1.0 / sq[branching]).mean()) if bool(branching.any()) else 1.0
        return Advantages(edges=edges, samples=leaf, metrics=metrics)


class LeafZScoreAdvantage(AdvantageEstimator):
    """Ablation "no backup": leaf z-scores aggregated over each edge's descendant leaves, ignoring the policy.

    Every edge ``e`` gets ``Σ_{ℓ ∈ desc(e)} A(ℓ)`` (``aggregate: sum``, the default) or its mean
    (``aggregate: mean``), where ``desc(e)`` are the decoded samples below ``e``:

    * ``sum`` treats every root-to-leaf path as an independent GRPO trajectory trained with its leaf's advantage
      (what DanceGRPO would do with these samples): an edge shared by ``n_e`` paths receives the sum of their
      advantages, so the (unclipped) gradient equals the per-path GRPO gradient up to a constant factor.
      Shared upper edges get larger magnitudes (sums of ``k^(d-1)`` z-scores for the first window step) and are
      more often clipped by the update rule's ``adv_clip_max``.
    * ``mean`` is the uniform average of descendant leaves, which on the sampler's complete ``k``-ary trees equals
      ``tree-backup`` with ``weights: uniform`` (kept for non-uniform trees and as a cross-check).

    Works on any rollout (on chains every edge has one descendant, so both modes reduce to plain per-sample GRPO).

    Args:
        aggregate: ``"sum"`` or ``"mean"`` over descendant leaves.
        multi_reward: As in :class:`TreeBackupAdvantage`.
        eps: Added to each prompt's (unbiased) leaf std.
    """

    name: ClassVar[str] = "leaf-zscore"
    requires: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        aggregate: Literal["sum", "mean"] = "sum",
        multi_reward: Literal["advantage", "reward"] = "advantage",
        eps: Annotated[float, Range(ge=0)] = 1e-8,
    ) -> None:
        self.aggregate: Literal["sum", "mean"] = aggregate
        self.multi_reward: Literal["advantage", "reward"] = multi_reward
        self.eps = float(eps)

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Descendant-leaf sums (or means) of the leaf z-scores; advantage 0 on non-trainable edges."""
        leaf = _leaf_advantages(rollout, scores, self.multi_reward, self.eps)
        total, count = descendant_leaf_totals(rollout, leaf)
        node = total if self.aggregate == "sum" else total / count.clamp_min(1.0)
        edges = node[rollout.edge_child]
        edges = torch.where(rollout.trainable, edges, torch.zeros_like(edges)).float()
        metrics = _common_metrics(rollout, scores, leaf, edges)
        return Advantages(edges=edges, samples=leaf, metrics=metrics)
