"""Backing leaf values up a rollout's tree: ``V(u) = Σ_e w_u(e)·V(child(e))``, vectorised per schedule level.

TreeGRPO (Ding & Ye, arXiv 2512.08153, Sec. "Method", step 3) weights a node's child edges by
``softmax(log π_old / τ)``; BranchGRPO (Li et al., arXiv 2509.06040; ``Fredreic1849/BranchGRPO``
``fastvideo/train_branchgrpo_flux.py``@19fbb9f L545-652) fuses rewards up its tree by the plain mean over a node's
leaves or by ``softmax(α·log π_child)``; TempFlow-GRPO's comb passes a child's reward back through single-child ODE
edges. All of these are :func:`backup_values` with a weighting; ``calibrated`` is rlpost's temperature-per-node
variant (``docs/algorithms/treegrpo.md``, "Beyond the paper").

Edges always go from step ``t`` to a later step, so processing parents by decreasing ``node_step`` is a topological
order: one ``index_add`` per level, never a Python loop over nodes.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from rlpost.core.contract import Rollout

__all__ = [
    "Weighting",
    "backup_values",
    "calibrated_weights",
    "descendant_leaf_totals",
    "edge_levels",
    "grouped_ess",
    "leaves_below",
]

Weighting = Literal["softmax", "uniform", "calibrated"]

# Bisection on log(τ / spread) in [-_LOG_BRACKET, _LOG_BRACKET]: at τ = 1e4·spread every weight is within 1e-4 of
# uniform, at τ = 1e-4·spread any child more than 1e-3·spread below the best gets a weight below e^-10 of the best's.
_LOG_BRACKET = 4.0 * math.log(10.0)
_BISECTIONS = 48  # halves the 18.4-wide bracket to ~7e-14 in log τ: far below any ESS tolerance that matters


def edge_levels(rollout: Rollout) -> list[tuple[int, Tensor]]:
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
    for _, e in edge_levels(rollout):
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


def descendant_leaf_totals(rollout: Rollout, leaf_values: Tensor) -> tuple[Tensor, Tensor]:
    """Sum and count of the decoded samples below every node (a sample counts at its own node).

    The plain aggregation over an edge's descendant leaves: ``total / count`` is BranchGRPO's mean-fused node reward
    (``Fredreic1849/BranchGRPO`` ``fastvideo/train_branchgrpo_flux.py``@19fbb9f L545-652), ``total`` TreeGRPO's
    ``leaf-zscore`` ablation.

    Args:
        rollout: The rollout (its node/edge table is the tree).
        leaf_values: ``[S]`` value of each decoded sample (aligned with ``rollout.sample_node``).

    Returns:
        ``(total [N], count [N])`` in float64.
    """
    n = rollout.num_nodes
    total = torch.zeros(n, dtype=torch.float64)
    count = torch.zeros(n, dtype=torch.float64)
    total.index_add_(0, rollout.sample_node, leaf_values.detach().double().cpu())
    count.index_add_(0, rollout.sample_node, torch.ones(rollout.num_samples, dtype=torch.float64))
    for _, e in edge_levels(rollout):
        parent, child = rollout.edge_parent[e], rollout.edge_child[e]
        total.index_add_(0, parent, total[child])
        count.index_add_(0, parent, count[child])
    return total, count


def leaves_below(rollout: Rollout, nodes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Every (node, decoded sample below it) pair of a tree rollout (a sample counts at its own node).

    Walks each sample's path up to its root, all samples at once (one step per tree level, never a loop over nodes).
    A rule that trains a tree's inner nodes towards the samples they led to (TreeNFT) gathers its pairs here.

    Args:
        rollout: The rollout; every node has at most one parent edge (a forest of trees, chains included).
        nodes: ``[M]`` long node indices to keep pairs of; ``None`` keeps every node's.

    Returns:
        ``(node [P], sample [P])`` long, sorted by node, then sample (indices into ``rollout.sample_node``).

    Raises:
        ValueError: A node has more than one parent edge.
    """
    n = rollout.num_nodes
    child = rollout.edge_child.cpu()
    if child.numel() and int(torch.bincount(child, minlength=n).max()) > 1:
        raise ValueError("leaves_below: a node has more than one parent edge; the rollout is not a forest of trees")
    parent_of = torch.full((n,), -1, dtype=torch.long)
    parent_of[child] = rollout.edge_parent.cpu()
    samples = torch.arange(rollout.num_samples)
    at = rollout.sample_node.cpu().clone()
    found_nodes, found_samples = [], []
    while at.numel():
        found_nodes.append(at)
        found_samples.append(samples)
        up = parent_of[at]
        keep = up >= 0
        at, samples = up[keep], samples[keep]
    node = torch.cat(found_nodes) if found_nodes else torch.zeros(0, dtype=torch.long)
    sample = torch.cat(found_samples) if found_samples else torch.zeros(0, dtype=torch.long)
    if nodes is not None:
        keep = torch.isin(node, nodes.cpu())
        node, sample = node[keep], sample[keep]
    order = torch.argsort(node * max(rollout.num_samples, 1) + sample)
    return node[order], sample[order]
