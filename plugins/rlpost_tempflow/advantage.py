"""TempFlow-GRPO advantages: each child's reward normalised within its prompt **and** branch step.

Upstream (``Shredded-Pork/TempFlow-GRPO`` ``scripts/train_sd3_pr.py``@e66824e, ``main``) stacks the rewards into a
``[trunks·6, T-1]`` matrix (one column per branch step) and hands it to Flow-GRPO's ``PerPromptStatTracker``, which
normalises each column within a prompt: ``A = (r - mean_{prompt, step}) / (std + 1e-4)`` with the population std of
the prompt's rows in that column (``global_std: false``, the ``pickscore_sd3_pr`` preset) or of every prompt's rows in
that column (``global_std: true``). A child's advantage is then the advantage of its branch edge: the edge's only
descendant sample is the child's completion, reached through single-child ODE edges
(:func:`rlpost.descendant_leaf_totals`).

Group scope: upstream's cross-rank gather is commented out, so its statistics are rank-local (a prompt's trunks
on one GPU); rlpost's groups are global: all ``trunks_per_prompt`` trunks of a prompt, whatever rank rolled them
out (``docs/algorithms/tempflow.md``, "Differences from upstream").
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
    descendant_leaf_totals,
    mix_rewards,
)

__all__ = ["TempFlowAdvantage", "sample_branch_steps"]


def sample_branch_steps(rollout: Rollout) -> Tensor:
    """``[S]`` schedule index of the trainable (branch) edge above each decoded sample (``-1`` when none).

    Walks from every sample back towards the root, all samples at once, and stops at the first trainable edge.
    """
    parent_edge = torch.full((rollout.num_nodes,), -1, dtype=torch.long)
    parent_edge[rollout.edge_child] = torch.arange(rollout.num_edges)
    out = torch.full((rollout.num_samples,), -1, dtype=torch.long)
    cur = rollout.sample_node.clone()
    idx = torch.arange(rollout.num_samples)
    while cur.numel():
        e = parent_edge[cur]
        keep = e >= 0
        cur, idx, e = cur[keep], idx[keep], e[keep]
        hit = rollout.trainable[e]
        out[idx[hit]] = rollout.node_step[rollout.edge_parent[e[hit]]]
        cur, idx = rollout.edge_parent[e[~hit]], idx[~hit]
    return out


class TempFlowAdvantage(AdvantageEstimator):
    """Per-(prompt, branch step) normalised child rewards, given to the children's branch edges.

    Args:
        global_std: ``false`` (the ``pickscore_sd3_pr`` preset): divide by the std of the prompt's children at that
            step; ``true``: by the std of every prompt's children at that step (Flow-GRPO's ``global_std``).
        std: ``"population"`` (upstream's ``np.std``) or ``"unbiased"`` (Bessel-corrected).
        eps: Added to the std (upstream 1e-4).
        multi_reward: ``"reward"``: normalise the weighted reward sum (upstream sums its rewards first);
            ``"advantage"``: weighted sum of per-reward normalised scores.
    """

    name: ClassVar[str] = "tempflow"
    requires: ClassVar[frozenset[str]] = frozenset({TREE})

    def __init__(
        self,
        global_std: bool = False,
        std: Literal["population", "unbiased"] = "population",
        eps: Annotated[float, Range(ge=0)] = 1e-4,
        multi_reward: Literal["advantage", "reward"] = "reward",
    ) -> None:
        self.global_std = bool(global_std)
        self.std: Literal["population", "unbiased"] = std
        self.eps = float(eps)
        self.multi_reward: Literal["advantage", "reward"] = multi_reward

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Normalise per (prompt, branch step), then pass each child's value to its branch edge."""
        step = sample_branch_steps(rollout)
        if bool((step < 0).any()):
            raise ValueError("tempflow advantage: some decoded sample has no trainable edge above it (not a comb)")
        prompt = (rollout.sample_group + rollout.group_offset).long()
        leaf = torch.zeros(rollout.num_samples, dtype=torch.float64)
        levels = torch.unique(step)
        for level in levels.tolist():
            # One call per step column: the std is the column's (per prompt, or over all prompts with global_std).
            sel = (step == level).nonzero().flatten()
            column = RewardScores({n: v[sel] for n, v in scores.scores.items()}, dict(scores.weights))
            z = mix_rewards(
                column,
                prompt[sel],
                mode=self.multi_reward,
                eps=self.eps,
                global_std=self.global_std,
                unbiased=self.std == "unbiased",
            )
            leaf[sel] = z.double().cpu()
        total, count = descendant_leaf_totals(rollout, leaf)
        node = total / count.clamp_min(1.0)
        edges = torch.where(rollout.trainable, node[rollout.edge_child], torch.zeros_like(node[rollout.edge_child]))
        edges = edges.float()
        raw = scores.weighted_sum().double().cpu()
        metrics = {
            "adv/abs_mean": float(edges[rollout.trainable].abs().mean()) if bool(rollout.trainable.any()) else 0.0,
            "adv/zero_frac": float((leaf == 0).double().mean()),
        }
        # Reward spread per branch step (the paper's Fig. 2: high at the first steps, vanishing at the last).
        for level in levels.tolist():
            metrics[f"tempflow/reward_std_step{level}"] = float(raw[step == level].std(unbiased=False))
        return Advantages(edges=edges, samples=leaf.float(), metrics=metrics)
