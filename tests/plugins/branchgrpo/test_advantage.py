"""branch-fusion on hand-built trees, against a node-by-node restatement of BranchGRPO's equations written here.

The reference below follows ``Fredreic1849/BranchGRPO`` ``fastvideo/train_branchgrpo_flux.py``@19fbb9f: node rewards
(L545-652: leaf = score; inner = mean of leaf descendants, or Σ softmax(α·logp_child)·R_child), per-depth z-scores
per tree (L655-687: unbiased std, +1e-8, zero for std < 1e-6 or a single node), the child's advantage on each edge
(L1199-1225), and ``--use_group`` leaf z-scores per prompt (L1100-1115). It walks Python node objects with the
``statistics`` module, sharing no code with the estimator.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from rlpost.core.contract import RewardScores, Rollout
from rlpost_branchgrpo.advantage import BranchFusionAdvantage

NAN = float("nan")


class Node:
    def __init__(self, idx: int, depth: int, logp: float = NAN, trainable: bool = True) -> None:
        self.idx, self.depth, self.logp, self.trainable = idx, depth, logp, trainable
        self.children: list[Node] = []
        self.reward = NAN
        self.adv = 0.0

    def leaves(self) -> list[Node]:
        return [self] if not self.children else [leaf for c in self.children for leaf in c.leaves()]

    def all(self) -> list[Node]:
        return [self] + [n for c in self.children for n in c.all()]


def build_tree(rng: random.Random, start: int, splits: list[int], steps: int) -> tuple[Node, int]:
    """A BranchGRPO tree: binary splits at ``splits``, one child elsewhere, the last step ODE (untrainable)."""
    idx = start
    root = Node(idx, 0)
    idx += 1
    frontier = [root]
    for t in range(steps):
        new = []
        for parent in frontier:
            for _ in range(2 if t in splits else 1):
                last = t == steps - 1
                child = Node(idx, t + 1, NAN if last else rng.uniform(-3, 1), not last)
                idx += 1
                parent.children.append(child)
                new.append(child)
        frontier = new
    return root, idx


def reference(roots: list[Node], rewards: dict[int, float], weighted: bool, use_group: bool) -> None:
    for root in roots:
        for leaf in root.leaves():
            leaf.reward = rewards[leaf.idx]
        if use_group:
            vals = [leaf.reward for leaf in root.leaves()]
            mu, sd = statistics.mean(vals), statistics.stdev(vals)
            for leaf in root.leaves():
                leaf.adv = (leaf.reward - mu) / (sd + 1e-8)
            continue
        nodes = root.all()
        for depth in range(max(n.depth for n in nodes) - 1, -1, -1):
            for n in (n for n in nodes if n.depth == depth and n.children):
                if not weighted:
                    n.reward = statistics.mean(leaf.reward for leaf in n.leaves())
                elif len(n.children) == 1:
                    n.reward = n.children[0].reward
                else:
                    m = max(c.logp for c in n.children)
                    w = [math.exp(c.logp - m) for c in n.children]
                    n.reward = sum(wi * c.reward for wi, c in zip(w, n.children, strict=True)) / sum(w)
        for depth in range(max(n.depth for n in nodes) + 1):
            level = [n for n in nodes if n.depth == depth]
            if len(level) <= 1:
                for n in level:
                    n.adv = 0.0
                continue
            vals = [n.reward for n in level]
            mu, sd = statistics.mean(vals), statistics.stdev(vals)
            for n in level:
                n.adv = 0.0 if sd < 1e-6 else (n.reward - mu) / (sd + 1e-8)


def to_rollout(roots: list[Node]) -> tuple[Rollout, list[tuple[Node, Node]]]:
    nodes = sorted((n for r in roots for n in r.all()), key=lambda n: n.idx)
    group = {n.idx: g for g, r in enumerate(roots) for n in r.all()}
    edges = [(p, c) for n in nodes for p, c in ((n, c) for c in n.children)]
    leaves = [leaf for r in roots for leaf in r.leaves()]
    rollout = Rollout(
        prompts=[f"p{g}" for g in range(len(roots))],
        metadata=[{} for _ in roots],
        sigmas=torch.linspace(1, 0, max(n.depth for n in nodes) + 1),
        states=torch.zeros(len(nodes), 1),
        node_step=torch.tensor([n.depth for n in nodes]),
        node_group=torch.tensor([group[n.idx] for n in nodes]),
        edge_parent=torch.tensor([p.idx for p, _ in edges]),
        edge_child=torch.tensor([c.idx for _, c in edges]),
        old_log_probs=torch.tensor([c.logp for _, c in edges], dtype=torch.float64),
        trainable=torch.tensor([c.trainable for _, c in edges]),
        edge_kernel=torch.tensor([0 if c.trainable else 1 for _, c in edges]),
        kernels=["dance-sde", "ode"],
        sample_node=torch.tensor([leaf.idx for leaf in leaves]),
        sample_group=torch.tensor([group[leaf.idx] for leaf in leaves]),
        media=torch.zeros(len(leaves), 1, 2, 2, 3, dtype=torch.uint8),
    )
    return rollout, edges


def forest(seed: int, splits: list[int], steps: int, trees: int = 2) -> tuple[list[Node], dict[int, float]]:
    rng = random.Random(seed)
    roots, idx = [], 0
    for _ in range(trees):
        root, idx = build_tree(rng, idx, splits, steps)
        roots.append(root)
    rewards = {leaf.idx: rng.gauss(0.3, 0.05) for r in roots for leaf in r.leaves()}
    return roots, rewards


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("splits", "steps"), [([0, 2], 5), ([0, 1, 3], 6), ([1], 3)])
def test_fusion_and_depth_normalisation_match_the_reference(weighted: bool, splits: list[int], steps: int) -> None:
    roots, rewards = forest(1, splits, steps)
    reference(roots, rewards, weighted, use_group=False)
    rollout, edges = to_rollout(roots)
    leaves = rollout.sample_node.tolist()
    scores = RewardScores({"r": torch.tensor([rewards[i] for i in leaves])}, {"r": 1.0})
    adv = BranchFusionAdvantage(tree_prob_weighted=weighted).estimate(rollout, scores)
    # Each edge parent -> child carries the child's advantage; the untrainable ODE edges carry 0.
    expected = torch.tensor([c.adv if c.trainable else 0.0 for _, c in edges], dtype=torch.float64)
    assert torch.allclose(adv.edges.double(), expected, atol=1e-5)
    assert bool((adv.edges[~rollout.trainable] == 0).all())
    assert float(adv.edges[rollout.trainable].abs().max()) > 0.1  # not trivially zero


def test_root_depth_is_zero_and_depths_are_per_tree() -> None:
    """Two trees whose rewards differ by a constant offset get the same advantages (normalised within each tree)."""
    roots, rewards = forest(2, [0, 2], 4)
    leaves_a, leaves_b = roots[0].leaves(), roots[1].leaves()
    for a, b in zip(leaves_a, leaves_b, strict=True):
        rewards[b.idx] = rewards[a.idx] + 10.0
    rollout, _ = to_rollout(roots)
    scores = RewardScores({"r": torch.tensor([rewards[i] for i in rollout.sample_node.tolist()])}, {"r": 1.0})
    adv = BranchFusionAdvantage().estimate(rollout, scores).edges
    half = rollout.num_edges // 2
    assert torch.allclose(adv[:half], adv[half:], atol=1e-4)  # float32 rewards near 10
    # Depth 1 holds the two split children of the root: z-scores ±1/sqrt(2) (unbiased std of two values).
    first = rollout.node_step[rollout.edge_parent] == 0
    assert torch.allclose(adv[first].abs(), torch.full((4,), 1 / math.sqrt(2)), atol=1e-6)


def test_constant_rewards_give_zero() -> None:
    roots, rewards = forest(3, [0, 1], 4)
    rollout, _ = to_rollout(roots)
    scores = RewardScores({"r": torch.full((rollout.num_samples,), 0.7)}, {"r": 1.0})
    adv = BranchFusionAdvantage().estimate(rollout, scores)
    assert bool((adv.edges == 0).all())


def test_use_group_leaf_zscores() -> None:
    """``use_group``: leaves are z-scored per prompt; a chain edge after the last split carries its leaf's z-score."""
    roots, rewards = forest(4, [0, 1], 5)
    reference(roots, rewards, weighted=False, use_group=True)
    rollout, edges = to_rollout(roots)
    scores = RewardScores({"r": torch.tensor([rewards[i] for i in rollout.sample_node.tolist()])}, {"r": 1.0})
    adv = BranchFusionAdvantage(use_group=True).estimate(rollout, scores)
    leaf_z = {leaf.idx: leaf.adv for r in roots for leaf in r.leaves()}
    assert torch.allclose(
        adv.samples.double(),
        torch.tensor([leaf_z[i] for i in rollout.sample_node.tolist()], dtype=torch.float64),
        atol=1e-5,
    )
    # Steps 2 and 3 come after the last split (step 1): each node there leads to exactly one leaf.
    for e, (p, c) in enumerate(edges):
        if c.trainable and p.depth >= 2:
            (leaf,) = c.leaves()
            assert float(adv.edges[e]) == pytest.approx(leaf_z[leaf.idx], abs=1e-5)
