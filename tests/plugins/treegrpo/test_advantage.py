"""The tree backup and the leaf z-score ablation on small hand-built rollouts (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.core.contract import RewardScores, Rollout
from rlpost.ops.trees.backup import backup_values, calibrated_weights, grouped_ess
from rlpost_treegrpo.advantage import LeafZScoreAdvantage, TreeBackupAdvantage
from tests.argument_checks import problems_of

NAN = float("nan")


def make_rollout(
    node_step: list[int],
    node_group: list[int],
    edges: list[tuple[int, int, float, bool]],
    samples: list[int],
    num_groups: int = 1,
) -> Rollout:
    """A rollout from a node list and ``(parent, child, old_log_prob, trainable)`` edges (kernel 0 = SDE, 1 = ODE)."""
    n, s = len(node_step), len(samples)
    parent, child, logp, train = zip(*edges, strict=True)
    return Rollout(
        prompts=[f"p{g}" for g in range(num_groups)],
        metadata=[{} for _ in range(num_groups)],
        sigmas=torch.linspace(1, 0, max(node_step) + 1),
        states=torch.zeros(n, 1),
        node_step=torch.tensor(node_step),
        node_group=torch.tensor(node_group),
        edge_parent=torch.tensor(parent),
        edge_child=torch.tensor(child),
        old_log_probs=torch.tensor(logp, dtype=torch.float32),
        trainable=torch.tensor(train),
        edge_kernel=torch.tensor([0 if t else 1 for t in train]),
        kernels=["flow-sde", "ode"],
        sample_node=torch.tensor(samples),
        sample_group=torch.tensor(node_group)[torch.tensor(samples)],
        media=torch.zeros(s, 1, 2, 2, 3, dtype=torch.uint8),
    )


def scores(values: list[float], **more: list[float]) -> RewardScores:
    table = {"r": torch.tensor(values)} | {k: torch.tensor(v) for k, v in more.items()}
    return RewardScores(scores=table, weights={k: 1.0 for k in table})


def zscore(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return (t - t.mean()) / t.std()  # unbiased (Bessel) std, the estimator's documented choice


def test_paper_example_one_node() -> None:
    """The paper summary's worked example: children advantages [1.0, 0.1, -0.2], probabilities [0.6, 0.3, 0.1].

    0.6·1.0 + 0.3·0.1 + 0.1·(-0.2) = 0.6 + 0.03 - 0.02 = 0.61. The summary prints "≈ 0.64", an arithmetic slip.
    """
    # Log-probs are only defined up to a shared constant within a sibling set: the softmax removes it.
    logp = [math.log(p) - 7.0 for p in (0.6, 0.3, 0.1)]
    r = make_rollout([0, 1, 1, 1], [0] * 4, [(0, 1 + j, logp[j], True) for j in range(3)], samples=[1, 2, 3])
    values, w = backup_values(r, torch.tensor([1.0, 0.1, -0.2]))
    assert values[0].item() == pytest.approx(0.61, abs=1e-6)
    torch.testing.assert_close(w, torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64), atol=1e-6, rtol=0)
    # Temperature divides log-probs: scaling them by τ and using temperature τ gives the same weights.
    r2 = make_rollout([0, 1, 1, 1], [0] * 4, [(0, 1 + j, 2.5 * logp[j], True) for j in range(3)], samples=[1, 2, 3])
    assert backup_values(r2, torch.tensor([1.0, 0.1, -0.2]), temperature=2.5)[0][0].item() == pytest.approx(0.61)
    # Uniform ablation: plain mean.
    assert backup_values(r, torch.tensor([1.0, 0.1, -0.2]), weights="uniform")[0][0].item() == pytest.approx(0.3)


def two_level_tree() -> tuple[Rollout, list[float]]:
    """root -ODE-> a; a branches to b1, b2 (window step 1); each b branches to two leaves (window step 2);
    each leaf has an ODE tail edge to its decoded node (step 3). One prompt group, 4 samples.

    nodes: 0 root(0), 1 a(1), 2 b1(2), 3 b2(2), 4..7 leaves(3), 8..11 decoded(4)
    """
    lp_b = [math.log(0.75), math.log(0.25)]
    lp_leaf = [math.log(0.5), math.log(0.5), math.log(0.9), math.log(0.1)]
    edges = [(0, 1, NAN, False), (1, 2, lp_b[0], True), (1, 3, lp_b[1], True)]
    edges += [(2, 4, lp_leaf[0], True), (2, 5, lp_leaf[1], True), (3, 6, lp_leaf[2], True), (3, 7, lp_leaf[3], True)]
    edges += [(4 + j, 8 + j, NAN, False) for j in range(4)]
    r = make_rollout([0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4], [0] * 12, edges, samples=[8, 9, 10, 11])
    return r, [3.0, 1.0, 0.0, 4.0]


def test_backup_two_levels_with_ode_pass_through() -> None:
    r, rewards = two_level_tree()
    out = TreeBackupAdvantage().estimate(r, scores(rewards))
    z = zscore(rewards)
    b1 = 0.5 * z[0] + 0.5 * z[1]
    b2 = 0.9 * z[2] + 0.1 * z[3]
    expected = torch.zeros(r.num_edges, dtype=torch.float64)
    expected[1], expected[2] = b1, b2  # edges into b1, b2
    expected[3:7] = z  # leaf edges get the leaf (= decoded sample, via the ODE tail) advantage
    torch.testing.assert_close(out.edges.double(), expected, atol=1e-6, rtol=0)
    assert out.edges.dtype == torch.float32
    assert out.edges[~r.trainable].abs().max() == 0  # trunk and tail edges: advantage 0
    # Backed-up value at a (not an edge advantage: the trunk edge is not trainable) is 0.75·b1 + 0.25·b2.
    values, _ = backup_values(r, z.float())
    assert values[1].item() == pytest.approx(float(0.75 * b1 + 0.25 * b2), abs=1e-6)
    assert values[0].item() == pytest.approx(values[1].item())  # single-child ODE node passes through
    # ESS of the branching nodes (a, b1, b2): 1/Σw² = 1/(0.75²+0.25²), 2, 1/(0.9²+0.1²).
    ess = (1 / (0.75**2 + 0.25**2) + 2.0 + 1 / (0.9**2 + 0.1**2)) / 3
    assert out.metrics["adv/backup_ess"] == pytest.approx(ess)
    assert out.metrics["adv/abs_mean"] == pytest.approx(float(expected[r.trainable].abs().mean()), abs=1e-6)
    assert out.metrics["adv/zero_std_frac"] == 0.0


def test_uniform_backup_and_leaf_zscore() -> None:
    r, rewards = two_level_tree()
    z = zscore(rewards)
    uni = TreeBackupAdvantage(weights="uniform").estimate(r, scores(rewards))
    mean = LeafZScoreAdvantage(aggregate="mean").estimate(r, scores(rewards))
    total = LeafZScoreAdvantage(aggregate="sum").estimate(r, scores(rewards))
    # On a complete binary tree the uniform backup equals the mean over descendant leaves.
    torch.testing.assert_close(uni.edges, mean.edges)
    assert uni.edges[1].item() == pytest.approx(float((z[0] + z[1]) / 2), abs=1e-6)
    assert total.edges[1].item() == pytest.approx(float(z[0] + z[1]), abs=1e-6)
    assert total.edges[2].item() == pytest.approx(float(z[2] + z[3]), abs=1e-6)
    torch.testing.assert_close(total.edges[3:7].double(), z, atol=1e-6, rtol=0)
    assert total.edges[~r.trainable].abs().max() == 0
    assert uni.metrics["adv/backup_ess"] == pytest.approx(2.0)


def test_leaf_zscores_per_prompt_and_zero_std_groups() -> None:
    """Two prompts of one-level trees with 3 leaves each, plus a third whose rewards are all equal."""
    edges, steps, groups, samples = [], [], [], []
    for g in range(3):
        root = len(steps)
        steps.append(0)
        groups.append(g)
        for _ in range(3):
            steps.append(1)
            groups.append(g)
            edges.append((root, len(steps) - 1, -1.0, True))
            samples.append(len(steps) - 1)
    r = make_rollout(steps, groups, edges, samples, num_groups=3)
    rewards = [1.0, 2.0, 6.0, -3.0, 10.0, 0.5, 7.0, 7.0, 7.0]
    out = TreeBackupAdvantage().estimate(r, scores(rewards))
    for g in range(2):
        leaf = out.samples[3 * g : 3 * g + 3].double()
        assert leaf.mean().item() == pytest.approx(0.0, abs=1e-6)
        assert leaf.std().item() == pytest.approx(1.0, abs=1e-6)
    assert out.samples[6:].abs().max() == 0  # equal rewards: zero advantage, never NaN
    assert torch.isfinite(out.edges).all()
    assert out.metrics["adv/zero_std_frac"] == pytest.approx(1 / 3)
    assert out.metrics["adv/backup_ess"] == pytest.approx(3.0)  # equal log-probs -> uniform weights


def test_multi_reward_mixed_on_advantages() -> None:
    r, hps = two_level_tree()
    clip = [0.2, 0.4, 0.3, 0.1]
    table = RewardScores(
        scores={"hps": torch.tensor(hps), "clip": torch.tensor(clip)}, weights={"hps": 0.8, "clip": 0.2}
    )
    adv = TreeBackupAdvantage(multi_reward="advantage").estimate(r, table)
    torch.testing.assert_close(adv.samples.double(), 0.8 * zscore(hps) + 0.2 * zscore(clip), atol=1e-6, rtol=0)
    rew = TreeBackupAdvantage(multi_reward="reward").estimate(r, table)
    mixed = [0.8 * a + 0.2 * b for a, b in zip(hps, clip, strict=True)]
    torch.testing.assert_close(rew.samples.double(), zscore(mixed), atol=1e-6, rtol=0)


def test_sum_reduction_sharpens_weights() -> None:
    """With summed log-probs (large magnitudes) the softmax is near one-hot: the backup follows the likeliest child."""
    logp = [-1000.0, -1010.0]
    r = make_rollout([0, 1, 1], [0] * 3, [(0, 1, logp[0], True), (0, 2, logp[1], True)], samples=[1, 2])
    values, w = backup_values(r, torch.tensor([1.0, -1.0]))
    assert w[0].item() == pytest.approx(1.0, abs=1e-4)
    assert values[0].item() == pytest.approx(1.0, abs=1e-4)


def test_validation_messages() -> None:
    problems = problems_of(TreeBackupAdvantage, "advantage", temperature=0.0, eps=-1.0)
    assert problems == [
        "advantage.init_args.temperature: must be > 0, got 0.0",
        "advantage.init_args.eps: must be >= 0, got -1.0",
    ]


def test_population_std_option_matches_the_official_code_normalisation() -> None:
    """``std: population`` divides by the ddof-0 std (the official code's leaf normalisation); the default unbiased."""
    r, rewards = two_level_tree()
    t = torch.tensor(rewards, dtype=torch.float64)
    population = (t - t.mean()) / t.std(unbiased=False)
    out = TreeBackupAdvantage(std="population").estimate(r, scores(rewards))
    torch.testing.assert_close(out.edges[3:7].double(), population, atol=1e-6, rtol=0)
    default = TreeBackupAdvantage().estimate(r, scores(rewards))
    # 4 leaves: the two differ by sqrt(4/3), far beyond the tolerance.
    ratio = out.edges[3:7] / default.edges[3:7]
    torch.testing.assert_close(ratio, torch.full((4,), (4 / 3) ** 0.5), rtol=1e-5, atol=1e-6)
    assert any("advantage.init_args.std" in p for p in TreeBackupAdvantage(std="ddof0").validate(None))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- calibrated weighting
def _sibling_sets(num_nodes: int, k: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parent = torch.arange(num_nodes).repeat_interleave(k)
    return torch.randn(num_nodes * k, generator=g, dtype=torch.float64) * scale, parent


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])  # mean-reduction-, unit- and sum-reduction-sized gaps
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("target", [0.4, 0.5, 0.75, 0.95])
def test_calibrated_weights_hit_the_target_ess(scale: float, k: int, target: float) -> None:
    """Every node's ESS 1/Σw² is target·k (when target·k > 1), whatever the log-prob scale."""
    logits, parent = _sibling_sets(40, k, scale, seed=k)
    w = calibrated_weights(logits, parent, 40, target)
    ess = grouped_ess(w, parent, 40)
    expected = max(1.0, target * k)
    assert torch.all((ess - expected).abs() < 1e-6), (float(ess.min()), float(ess.max()), expected)


def test_calibrated_weights_limits_and_order() -> None:
    """target 1 = uniform; target <= 1/k = one-hot on the most probable child; small targets approach one-hot;
    the weights keep the softmax's order and do not depend on shifting or scaling the log-probs."""
    logits, parent = _sibling_sets(30, 3, 1.0, seed=7)
    uniform = calibrated_weights(logits, parent, 30, 1.0)
    torch.testing.assert_close(uniform, torch.ones_like(uniform))
    best = logits.view(30, 3).argmax(1)
    onehot = calibrated_weights(logits, parent, 30, 0.0).view(30, 3)
    torch.testing.assert_close(onehot, torch.nn.functional.one_hot(best, 3).double())
    # Normalised weights of the best child rise towards 1 as the target falls towards 1/k.
    tops = []
    for target in (0.9, 0.6, 0.4, 0.34):
        w = calibrated_weights(logits, parent, 30, target).view(30, 3)
        w = w / w.sum(1, keepdim=True)
        tops.append(float(w.gather(1, best[:, None]).min()))
        lg = logits.view(30, 3)
        # The paper's ordering: a more probable child never weighs less (pairwise differences agree in sign).
        assert bool(((w[:, :, None] - w[:, None, :]) * (lg[:, :, None] - lg[:, None, :]) >= 0).all())
    assert tops == sorted(tops) and tops[-1] > 0.9
    shifted = calibrated_weights(5.0 * logits - 3.0, parent, 30, 0.5)
    w0 = calibrated_weights(logits, parent, 30, 0.5)
    torch.testing.assert_close(
        shifted / shifted.view(30, 3).sum(1).repeat_interleave(3), w0 / w0.view(30, 3).sum(1).repeat_interleave(3)
    )


def test_calibrated_backup_is_a_finite_convex_combination() -> None:
    """The backed-up value lies between the children's values (weights >= 0, summing to 1 per node); equal log-probs
    (no spread to calibrate) give uniform weights and finite values."""
    r, _ = two_level_tree()
    leaf = torch.tensor([1.0, -1.0, 0.5, -0.5])
    values, w = backup_values(r, leaf, "calibrated", target_ess=0.6)
    counts = r.children_count()
    sums = torch.zeros(r.num_nodes, dtype=torch.float64).index_add_(0, r.edge_parent, w)
    torch.testing.assert_close(sums[counts > 0], torch.ones(int((counts > 0).sum()), dtype=torch.float64))
    assert bool((w >= 0).all())
    for u in range(r.num_nodes):
        kids = r.edge_child[r.edge_parent == u]
        if len(kids) > 1:
            assert float(values[kids].min()) - 1e-12 <= float(values[u]) <= float(values[kids].max()) + 1e-12
    equal = make_rollout([0, 1, 1, 1], [0] * 4, [(0, 1 + j, -2.0, True) for j in range(3)], samples=[1, 2, 3])
    values, w = backup_values(equal, torch.tensor([1.0, 0.1, -0.2]), "calibrated", target_ess=0.5)
    assert bool(torch.isfinite(values).all())
    torch.testing.assert_close(w, torch.full((3,), 1 / 3, dtype=torch.float64))
    est = TreeBackupAdvantage(weights="calibrated", target_ess=0.5)
    out = est.estimate(equal, scores([1.0, 0.1, -0.2]))
    assert bool(torch.isfinite(out.edges).all()) and out.metrics["adv/backup_ess"] == pytest.approx(3.0)


def test_calibrated_estimator_reports_the_target_ess_and_validates() -> None:
    logp = [-1.0, -1.2, -0.7]
    r = make_rollout([0, 1, 1, 1], [0] * 4, [(0, 1 + j, logp[j], True) for j in range(3)], samples=[1, 2, 3])
    out = TreeBackupAdvantage(weights="calibrated", target_ess=0.6).estimate(r, scores([1.0, 0.1, -0.2]))
    assert out.metrics["adv/backup_ess"] == pytest.approx(1.8, abs=1e-6)
    problems = problems_of(TreeBackupAdvantage, "advantage", weights="calibrated", target_ess=1.5)
    assert problems == ["advantage.init_args.target_ess: must be in [0, 1], got 1.5"]
    with pytest.raises(ValueError, match="target_ess"):
        backup_values(r, torch.zeros(3), "calibrated", target_ess=-0.1)
