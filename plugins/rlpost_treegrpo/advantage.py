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

import math
from typing import Annotated, ClassVar, Literal

import torch
from torch import Tensor

from rlpost import TREE, AdvantageEstimator, Advantages, Range, RewardScores, Rollout, constant_groups, mix_rewards

__all__ = [
    "LeafZScoreAdvantage",
    "TreeBackupAdvantage",
    "backup_values",
    "calibrated_weights",
    "grouped_ess",
    "zero_std_fraction",
]

Weighting = Literal["softmax", "uniform", "calibrated"]

# Bisection on log(τ / spread) in [-_LOG_BRACKET, _LOG_BRACKET]: at τ = 1e4·spread every weight is within 1e-4 of
# uniform, at τ = 1e-4·spread any child more than 1e-3·spread below the best gets a weight below e^-10 of the best's.
_LOG_BRACKET = 4.0 * math.log(10.0)
_BISECTIONS = 48  # halves the 18.4-wide bracket to ~7e-14 in log τ: far below any ESS tolerance that matters


def _levels(rollout: Rollout) -> list[tuple[int, Tensor]]:
    """Edge indices grouped by their parent's schedule index, deepest level first."""
    step = rollout.node_step[rollout.edge_parent]
    return [(int(t), (step == t).nonzero().flatten()) for t in torch.unique(step).flip(0).tolist()]


def backup_values(
    rollout: Rollout,
    leaf_values: Tensor,
    weights: Weighting = "softmax",
    temperature: float = 1.0,
    target_ess: float = 0.5,
) -> tuple[Tensor, Tensor]:
    """Back ``leaf_values`` up the rollout's tree: ``V(u) = Σ_e w_u(e)·V(child(e))`` (TreeGRPO §2.3, step 3).

    Args:
        rollout: The rollout (its node/edge table is the tree).
        leaf_values: ``[S]`` value of each decoded sample (aligned with ``rollout.sample_node``).
        weights: ``"softmax"``: ``w_u = softmax(log π_old / temperature)`` over ``u``'s child edges (the paper);
            ``"uniform"``: ``w_u = 1/|S(u)|`` (ablation). Nodes with one child use weight 1 either way, so
            deterministic (NaN log-prob) edges pass values through. ``"calibrated"``: softmax of the log-probs with
            a per-node temperature chosen so the weights' effective sample size is ``target_ess·|S(u)|``
            (:func:`calibrated_weights`).
        temperature: Softmax temperature ``τ > 0`` (``"softmax"`` only).
        target_ess: Target effective sample size as a fraction of the node's children (``"calibrated"`` only):
            ``1`` gives uniform weights, ``≤ 1/|S(u)|`` the one-hot weight on the most probable child.

    Returns:
        ``(node_values [N], edge_weights [E])``: the backed-up value of every node (NaN for nodes that reach no
        sample) and the weight each edge received within its sibling set.
    """
    if temperature <= 0:
        raise ValueError(f"backup temperature must be > 0, got {temperature}")
    if not 0.0 <= target_ess <= 1.0:
        raise ValueError(f"backup target_ess must be in [0, 1], got {target_ess}")
    n = rollout.num_nodes
    values = torch.full((n,), float("nan"), dtype=torch.float64)
    values[rollout.sample_node] = leaf_values.detach().double().cpu()
    edge_w = torch.zeros(rollout.num_edges, dtype=torch.float64)
    counts = rollout.children_count()
    for _, e in _levels(rollout):
        parent, child = rollout.edge_parent[e], rollout.edge_child[e]
        single = counts[parent] == 1
        if weights == "uniform":
            unnorm = torch.ones(e.shape[0], dtype=torch.float64)
        else:
            logits = rollout.old_log_probs[e].double()
            # Single-child (ODE) edges carry NaN log-probs: give them logit 0 (their weight is 1 regardless).
            logits = torch.where(single | torch.isnan(logits), torch.zeros_like(logits), logits)
            if weights == "calibrated":
                unnorm = calibrated_weights(logits, parent, n, target_ess)
            else:
                logits = logits / temperature
                # Grouped (per-parent) softmax: subtract each parent's max for stability.
                unnorm = torch.exp(logits - _group_max(logits, parent, n)[parent])
        denom = torch.zeros(n, dtype=torch.float64).index_add_(0, parent, unnorm)
        w = unnorm / denom[parent]
        edge_w[e] = w
        contrib = w * values[child]
        values[parent] = torch.zeros(n, dtype=torch.float64).index_add_(0, parent, contrib)[parent]
    return values, edge_w


def _group_max(values: Tensor, parent: Tensor, n: int) -> Tensor:
    """``[n]`` maximum of ``values`` per parent (``-inf`` for nodes without edges here)."""
    return torch.full((n,), float("-inf"), dtype=values.dtype).scatter_reduce(
        0, parent, values, reduce="amax", include_self=True
    )


def grouped_ess(weights: Tensor, parent: Tensor, n: int) -> Tensor:
    """``[n]`` effective sample size ``(Σw)² / Σw²`` of each parent's (unnormalised) edge weights (0 without edges)."""
    total = torch.zeros(n, dtype=weights.dtype).index_add_(0, parent, weights)
    sq = torch.zeros(n, dtype=weights.dtype).index_add_(0, parent, weights**2)
    return torch.where(sq > 0, total**2 / sq.clamp_min(torch.finfo(weights.dtype).tiny), torch.zeros_like(sq))


def calibrated_weights(logits: Tensor, parent: Tensor, n: int, target_ess: float) -> Tensor:
    """Per-parent softmax weights of ``logits`` with a per-parent temperature hitting an effective sample size.

    For each parent ``u`` with ``k_u`` child edges, find ``τ_u`` with ``ESS(softmax(ℓ/τ_u)) = target_ess·k_u``, where
    ``ESS(w) = 1/Σw²`` runs from 1 (one-hot) to ``k_u`` (uniform). The ESS of tempered softmax weights grows
    monotonically with ``τ`` (it is the exponential of their Rényi-2 entropy, and the Rényi entropies of
    ``p ∝ exp(ℓ/τ)`` increase with ``τ``), so one bisection on ``log τ`` per parent finds it; all parents are bisected
    at once (one scatter per iteration, no loop over nodes). The bracket is relative to each parent's logit spread
    ``max ℓ - min ℓ``, which makes the weights invariant to shifting and rescaling the log-probs: they depend only on
    the children's order and relative gaps, never on whether the sampler reduced per-element densities by mean or sum.

    Edge cases: ``target_ess·k_u ≥ k_u`` or equal logits give uniform weights; ``target_ess·k_u ≤ 1`` gives the
    one-hot weight on the most probable child (shared equally among exact ties); a target the bracket cannot reach
    (a near-tie at the top) ends at the bracket's lower end, the closest it gets.

    Args:
        logits: ``[E]`` finite old log-probs of the edges of one schedule level.
        parent: ``[E]`` parent node of each edge.
        n: Number of nodes (size of the per-node tables).
        target_ess: Target ESS as a fraction of each parent's child count, in ``[0, 1]``.

    Returns:
        ``[E]`` unnormalised positive weights (normalise per parent); their per-parent ESS is the target.
    """
    ones = torch.ones_like(logits)
    k = torch.zeros(n, dtype=logits.dtype).index_add_(0, parent, ones)
    peak = _group_max(logits, parent, n)
    low = -_group_max(-logits, parent, n)
    spread = (peak - low)[parent]
    gap = logits - peak[parent]  # <= 0, exactly 0 at the best child
    target = target_ess * k  # [n]
    onehot_nodes = target <= 1.0
    flat = (spread <= 0) | (target[parent] >= k[parent])
    safe_spread = torch.where(spread > 0, spread, ones)
    lo = torch.full((n,), -_LOG_BRACKET, dtype=logits.dtype)
    hi = torch.full((n,), _LOG_BRACKET, dtype=logits.dtype)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        w = torch.exp(gap / (safe_spread * torch.exp(mid[parent])))
        too_flat = grouped_ess(w, parent, n) > target  # ESS above target: lower the temperature
        hi = torch.where(too_flat, mid, hi)
        lo = torch.where(too_flat, lo, mid)
    w = torch.exp(gap / (safe_spread * torch.exp(0.5 * (lo + hi))[parent]))
    w = torch.where(onehot_nodes[parent], (gap == 0).to(logits.dtype), w)
    return torch.where(flat & ~onehot_nodes[parent], ones, w)


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
        n = rollout.num_nodes
        total = torch.zeros(n, dtype=torch.float64)
        count = torch.zeros(n, dtype=torch.float64)
        total.index_add_(0, rollout.sample_node, leaf.double())
        count.index_add_(0, rollout.sample_node, torch.ones(rollout.num_samples, dtype=torch.float64))
        for _, e in _levels(rollout):
            parent, child = rollout.edge_parent[e], rollout.edge_child[e]
            total.index_add_(0, parent, total[child])
            count.index_add_(0, parent, count[child])
        node = total if self.aggregate == "sum" else total / count.clamp_min(1.0)
        edges = node[rollout.edge_child]
        edges = torch.where(rollout.trainable, edges, torch.zeros_like(edges)).float()
        metrics = _common_metrics(rollout, scores, leaf, edges)
        return Advantages(edges=edges, samples=leaf, metrics=metrics)
