"""TreeNFT's update rule on the toy linear policy and a hand-built tree: the gradient of one step equals an independent
computation from the equations (DiffusionNFT's loss, arXiv 2509.16117 Sec. 3, at each trained node towards every leaf
below it, target ``v* = (x_u - x0_ℓ)/σ_u``), only the live policy is trained, the counted rows are the closed form,
and the declared argument ranges.

The toy velocity is ``v = a·x + b_prompt`` (``tests/toy_components.py``): the old copy and the reference are the same
field with other values of ``a``, so ``∂ℓ/∂a`` is formed here by autograd on a fresh fp64 scalar.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from rlpost import (
    Advantages,
    Rollout,
    UpdateContext,
    grid_permutations,
    leaves_below,
    noise_for,
    sample_keys,
)
from rlpost.engine.weight_copies import CopyConfig, EngineCopies
from rlpost.testing import sample_rollout
from rlpost_treegrpo.sampler import TreeSampler
from rlpost_treenft.update import OLD, TreeNFTUpdate
from tests.argument_checks import problems_of
from tests.plugins.old_copy_helpers import A_REF, RecordingBackend, RefToyPolicy

A_LIVE, A_OLD = -1.0, -0.8
SEED, STEP, M = 5, 2, 5.0
SIGMAS = [1.0, 0.75, 0.5, 0.25, 0.0]
PROMPTS = ["a red cube", "two cats"]
# One tree per prompt, 12 nodes each: n0 -ode-> n1; n1 -> n2, n3; n2 -> n4, n5; n3 -> n6, n7 (the window, trainable);
# n4..n7 -ode-> n8..n11, the decoded samples 0..3 of the tree.
EDGES = [(0, 1, False), (1, 2, True), (1, 3, True), (2, 4, True), (2, 5, True), (3, 6, True), (3, 7, True)]
EDGES += [(4 + i, 8 + i, False) for i in range(4)]
STEPS = [0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
# Written out by hand: the samples (of the tree) below each inner node, and which nodes each setting trains.
BELOW = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [0, 1], 3: [2, 3]}
TRAINED = {"window": [1, 2, 3], "window+trunk": [0, 1, 2, 3]}
ADVANTAGES = [-7.0, -2.0, 0.5, 1.5, 3.0, 8.0, -0.5, 0.0]  # beyond ±M on both sides


def hand_built_tree() -> Rollout:
    """Two prompts, one tree each (the layout above), random fp32 states."""
    g = torch.Generator().manual_seed(7)
    n = len(STEPS)
    parent = [p + 12 * t for t in range(2) for p, _, _ in EDGES]
    child = [c + 12 * t for t in range(2) for _, c, _ in EDGES]
    trainable = [tr for _ in range(2) for _, _, tr in EDGES]
    return Rollout(
        prompts=list(PROMPTS),
        metadata=[{}, {}],
        sigmas=torch.tensor(SIGMAS),
        states=torch.randn(2 * n, 1, 2, 2, generator=g),
        node_step=torch.tensor(STEPS * 2),
        node_group=torch.tensor([0] * n + [1] * n),
        edge_parent=torch.tensor(parent),
        edge_child=torch.tensor(child),
        old_log_probs=torch.where(torch.tensor(trainable), -1.0, float("nan")).double(),
        trainable=torch.tensor(trainable),
        edge_kernel=torch.tensor([0 if t else 1 for t in trainable]),
        kernels=["flow-sde", "ode"],
        sample_node=torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]),
        sample_group=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        media=torch.zeros(8, 1, 2, 2, 3, dtype=torch.uint8),
    )


def _setup(rollout: Rollout | None = None) -> tuple[RefToyPolicy, EngineCopies, UpdateContext]:
    policy = RefToyPolicy(scale=A_LIVE)
    policy.setup(torch.device("cpu"))
    rollout = rollout if rollout is not None else hand_built_tree()
    params = policy.trainable_parameters()
    copies = EngineCopies(policy, params, {OLD: CopyConfig()})
    copies.shadows[OLD][0].fill_(A_OLD)
    values = (ADVANTAGES * 2)[: rollout.num_samples]
    adv = Advantages(edges=torch.zeros(rollout.num_edges), samples=torch.tensor(values))
    sampler: Any = None  # the rule never calls the sampler
    ctx = UpdateContext(policy, sampler, rollout, adv, RecordingBackend(params), torch.Generator(), STEP, copies, SEED)
    return policy, copies, ctx


def _pair_loss(a: Tensor, x: Tensor, sigma: float, target: Tensor, bias: Tensor, r: float, beta: float, kl: float):
    """The paper's per-pair loss in velocity space: ``x̂0± - x0 = σ·(v* - v±)``, weights held constant."""
    v_theta, v_old, v_ref = (c * x + bias for c in (a, A_OLD, A_REF))
    losses = []
    for v in (beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta):
        err = sigma * (target - v)
        losses.append((err**2).mean() / max(float(err.abs().mean()), 1e-5))
    return M * (r * losses[0] + (1 - r) * losses[1]) / beta + kl * ((v_theta - v_ref) ** 2).mean()


def _expected(rollout: Rollout, nodes: str, beta: float, kl: float, fresh: int) -> tuple[float, float, int]:
    """``(∂loss/∂a, loss, rows)``: the mean over trained nodes (each the mean over its leaves) and fresh rows."""
    states = rollout.states.double()
    bias = RefToyPolicy().encode(PROMPTS).tensors["bias"].double()
    r = [0.5 + 0.5 * min(max(adv / M, -1.0), 1.0) for adv in ADVANTAGES]
    a = torch.tensor(A_LIVE, dtype=torch.float64, requires_grad=True)
    rows = []
    for tree in range(2):
        for u in TRAINED[nodes]:
            x, sigma = states[12 * tree + u], SIGMAS[STEPS[u]]
            pairs = []
            for leaf in BELOW[u]:
                s = 4 * tree + leaf
                x0 = states[int(rollout.sample_node[s])]
                pairs.append(_pair_loss(a, x, sigma, (x - x0) / sigma, bias[tree], r[s], beta, kl))
            rows.append(sum(pairs) / len(pairs))
    if fresh:
        keys = sample_keys(rollout)
        slots = grid_permutations(SEED, STEP, keys, len(SIGMAS) - 1, fresh)
        for s, key in enumerate(keys):
            x0 = states[int(rollout.sample_node[s])]
            for i in slots[s].tolist():
                t = SIGMAS[i]
                eps = noise_for(SEED, STEP, key, x0.shape, i).double()
                x_t = (1 - t) * x0 + t * eps
                rows.append(_pair_loss(a, x_t, t, eps - x0, bias[s // 4], r[s], beta, kl))
    loss = sum(rows) / len(rows)
    loss.backward()
    assert a.grad is not None
    return float(a.grad), float(loss), len(rows)


def test_leaves_below_lists_every_sample_under_each_node():
    node, sample = leaves_below(hand_built_tree())
    got: dict[int, list[int]] = {}
    for u, s in zip(node.tolist(), sample.tolist(), strict=True):
        got.setdefault(u, []).append(s)
    for tree in range(2):
        for u, leaves in BELOW.items():
            assert got[12 * tree + u] == [4 * tree + leaf for leaf in leaves]
        for i in range(4):  # the window's last level and the samples: one sample each
            assert got[12 * tree + 4 + i] == got[12 * tree + 8 + i] == [4 * tree + i]
    only = leaves_below(hand_built_tree(), torch.tensor([2, 15]))
    assert only[0].tolist() == [2, 2, 15, 15] and only[1].tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize(("beta", "kl_beta"), [(1.0, 1e-4), (0.1, 0.5)])
@pytest.mark.parametrize("minibatch", [1, 4, 100])
@pytest.mark.parametrize("nodes", ["window", "window+trunk"])
@pytest.mark.parametrize("fresh", [0, 2])
def test_gradient_equals_the_equations_on_a_hand_built_tree(beta, kl_beta, minibatch, nodes, fresh):
    policy, copies, ctx = _setup()
    rule = TreeNFTUpdate(beta=beta, kl_beta=kl_beta, nodes=nodes, fresh_rows=fresh, minibatch_rows=minibatch)
    rows0 = policy.forward_count
    result = rule.update(ctx)
    grad, loss, rows = _expected(ctx.rollout, nodes, beta, kl_beta, fresh)
    backend = ctx.backend
    assert isinstance(backend, RecordingBackend)
    assert float(backend.grads[0]) == pytest.approx(grad, rel=1e-5)
    assert result.metrics["loss/total"] == pytest.approx(loss, rel=1e-5)
    assert rows == 2 * len(TRAINED[nodes]) + 8 * fresh
    with_ref = kl_beta > 0
    assert result.train_forwards == rows and result.trained_edges == 0 and result.nonfinite_losses == 0
    assert dict(result.copy_forwards) == ({OLD: rows, "reference": rows} if with_ref else {OLD: rows})
    # One live, one old (and one reference) forward per trained node or fresh row: no forward per (node, leaf) pair.
    assert policy.forward_count - rows0 == result.train_forwards + result.reference_forwards
    assert result.metrics["train/nodes"] == 2 * len(TRAINED[nodes])
    assert result.metrics["train/pairs"] == 2 * sum(len(BELOW[u]) for u in TRAINED[nodes])


def test_only_the_live_policy_is_trained():
    """The old copy and the reference enter without gradient (a velocity of theirs computed with gradient would hang
    on the same parameter ``a``, swapped, and change the gradient checked against the equations above); the update
    leaves the old copy's shadow and the live weights as they were, and every swap is undone."""
    policy, copies, ctx = _setup()
    old, live = copies.shadows[OLD][0].clone(), policy.a.detach().clone()
    TreeNFTUpdate(minibatch_rows=3, kl_beta=0.1).update(ctx)
    assert torch.equal(copies.shadows[OLD][0], old) and torch.equal(policy.a.detach(), live)
    assert isinstance(ctx.backend, RecordingBackend) and float(ctx.backend.grads[0]) != 0.0
    assert policy.a.grad is None  # the backend's step took the only gradient there was


def _tree_step(window: str, start: int | None, step: int) -> tuple[TreeSampler, RefToyPolicy, UpdateContext]:
    sampler = TreeSampler(num_steps=5, k=2, depth=2, window=window, fixed_start=start, trees_per_prompt=2)
    policy = RefToyPolicy(scale=A_LIVE)
    policy.setup(torch.device("cpu"))
    rollout = sample_rollout(sampler, policy, groups=2, samples_per_group=1, seed=step, step=step)
    _, _, ctx = _setup(rollout)
    ctx.policy = policy
    ctx.copies = EngineCopies(policy, policy.trainable_parameters(), {OLD: CopyConfig()})
    return sampler, policy, ctx


@pytest.mark.parametrize(("nodes", "fresh", "kl_beta"), [("window", 0, 1e-4), ("window+trunk", 1, 0.0)])
@pytest.mark.parametrize("start", [0, 1, 2])
def test_counted_rows_equal_the_closed_form(nodes, fresh, kl_beta, start):
    sampler, policy, ctx = _tree_step("fixed", start, 0)
    rule = TreeNFTUpdate(nodes=nodes, fresh_rows=fresh, kl_beta=kl_beta, minibatch_rows=5)
    rule.bind_sampler(sampler)
    expected = rule.train_counts(sampler.step_counts(2, 1))
    trees, window = 4, 1 + 2  # 2 prompts x 2 trees; Σ_{j<2} 2^j window parents per tree
    closed = trees * window + (trees * start if nodes == "window+trunk" else 0) + 16 * fresh
    assert expected.grad_rows == closed
    assert dict(expected.nograd_rows) == ({OLD: closed, "reference": closed} if kl_beta else {OLD: closed})
    rows0 = policy.forward_count
    result = rule.update(ctx)
    assert result.train_forwards == expected.grad_rows and result.reference_forwards == expected.nograd_total
    assert dict(result.copy_forwards) == dict(expected.nograd_rows)
    assert policy.forward_count - rows0 == expected.grad_rows + expected.nograd_total


def test_trunk_count_follows_the_drawn_window_start():
    starts = set()
    for step in range(6):
        sampler, policy, ctx = _tree_step("uniform", None, step)
        rule = TreeNFTUpdate(nodes="window+trunk", minibatch_rows=64)
        rule.bind_sampler(sampler)
        starts.add(sampler.window_start)
        expected = rule.train_counts(sampler.step_counts(2, 1))
        assert expected.grad_rows == 4 * 3 + 4 * int(sampler.window_start or 0)
        assert rule.update(ctx).train_forwards == expected.grad_rows
    assert len(starts) > 1  # the check saw more than one trunk length


def test_copies_rollout_copy_and_requires():
    rule = TreeNFTUpdate()
    assert rule.required_copies() == {OLD} and rule.rollout_copy(0) == OLD and rule.rollout_copy(99) == OLD
    live = TreeNFTUpdate(rollout_policy="live")
    assert live.required_copies() == {OLD} and live.rollout_copy(0) is None
    assert rule.requires == {"tree", "clean-samples"}
    with pytest.raises(ValueError, match="bind_sampler"):
        TreeNFTUpdate(nodes="window+trunk").train_counts(TreeSampler(num_steps=5, k=2, depth=2).counts(1, 1))


def test_nonfinite_loss_never_reaches_backward():
    """A NaN old copy makes every loss NaN: none is passed to ``backward``, each pass is counted."""
    policy, copies, ctx = _setup()
    copies.shadows[OLD][0].fill_(float("nan"))
    result = TreeNFTUpdate(minibatch_rows=4).update(ctx)
    backend = ctx.backend
    assert isinstance(backend, RecordingBackend)
    assert backend.backward_calls == 0 and result.nonfinite_losses == 2  # 6 window nodes in passes of 4
    assert float(backend.grads[0]) == 0.0 and bool(torch.isfinite(policy.a).all())


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"beta": 0.0}, "optimizer.init_args.beta: must be > 0, got 0.0"),
        ({"kl_beta": -1e-4}, "optimizer.init_args.kl_beta: must be >= 0, got -0.0001"),
        ({"adv_clip_max": 0.0}, "optimizer.init_args.adv_clip_max: must be > 0, got 0.0"),
        ({"fresh_rows": -1}, "optimizer.init_args.fresh_rows: must be >= 0, got -1"),
        ({"minibatch_rows": 0}, "optimizer.init_args.minibatch_rows: must be >= 1, got 0"),
        ({"train_guidance": 0.5}, "optimizer.init_args.train_guidance: must be >= 1, got 0.5"),
    ],
)
def test_declared_ranges(kwargs, problem):
    assert problems_of(TreeNFTUpdate, "optimizer", **kwargs) == [problem]
