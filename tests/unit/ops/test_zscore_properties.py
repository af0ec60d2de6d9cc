"""Properties every group-normalising advantage estimator must have (seeded random cases, plain parametrisation).

Estimators: ``group-zscore`` (group / global std, both multi-reward modes), ``tree-backup`` (softmax / uniform),
``leaf-zscore`` (sum / mean) and DDPO's ``per-prompt`` tracker. Properties:

1. A prompt group whose rewards are all equal gets advantage exactly 0 on every sample and edge, also when the
   constant is not representable in float32 (0.1, 0.3, 0.999, JPEG sizes / 1000): the float32 formula divides an
   ulp of rounding noise by an ulp of rounding noise there and used to give |A| ~ 0.6-1.0.
   Exact zero is the documented guarantee (``docs/rewards.md``, "Multi-reward recipes"), so it is tested bitwise.
2. Storing the same forest in another node / edge / sample order permutes the advantages the same way.
3. Z-scores are invariant to a positive affine change ``a·R + b`` of the rewards (per source in ``advantage`` mode;
   a common scale with per-source shifts in ``reward`` mode).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from rlpost.components.group_zscore import GroupZScoreAdvantage
from rlpost.core.api import AdvantageEstimator, Advantages
from rlpost.core.contract import RewardScores, Rollout
from rlpost.ops.reward_mixing import group_zscore
from rlpost_ddpo.advantage import PerPromptStatTracker
from rlpost_treegrpo.advantage import LeafZScoreAdvantage, TreeBackupAdvantage

# Constants that float32 cannot represent exactly (0.7 and 0.999 too), plus exact ones for contrast.
INEXACT = [0.1, 0.3, 0.7, 0.999, 2.345]
EXACT = [0.0, 1.0, -0.5]

# Tolerance of the order and affine properties. The estimators compute in float64 and return float32, so a storage
# permutation changes results by about one float32 ulp (6e-8 relative). For ``a·R + b`` the transformed rewards are
# rounded to float32 again, an error of ~6e-8·|a·R + b| ≈ 1e-6 for |a·R + b| <= 25, which the z-score divides by
# a·std(R) >= 0.25·0.28: at most ~1e-5 per leaf z-score, and leaf-zscore ``sum`` adds up to 27 of them. DDPO's std
# eps (1e-6) does not scale with a and moves a z-score by ~eps·|1/a - 1|/std·|z|: up to ~7e-5 here (measured).
# A real defect is of order 1: a z-score left unscaled moves by a factor a (|a - 1| >= 0.5 here), an uncentred
# one by b/std, a misaligned sample by a whole z (test_affine_tolerance_catches_an_unnormalised_estimator).
PROPERTY_ATOL = 3e-4


# --------------------------------------------------------------------------------------------- forests
@dataclass
class Forest:
    """A rollout plus, for each stored sample / edge, the index of the same sample / edge in canonical order."""

    rollout: Rollout
    sample_of: Tensor  # [S] canonical sample index of stored sample i
    edge_of: Tensor  # [E] canonical edge index of stored edge j


def forest(
    group_sizes: list[tuple[int, int, int]], gen: torch.Generator, shuffle: torch.Generator | None = None
) -> Forest:
    """Prompt groups of ``(trees, k, depth)``: per tree a root, one ODE trunk edge, ``depth`` branching SDE levels
    with ``k`` children each (trainable, random log-probs) and one ODE tail edge per leaf; ``k = 1`` gives chains.

    With ``shuffle`` the nodes, edges and samples are stored in a random order (the log-probs are drawn in canonical
    order from ``gen`` first, so both orders describe the same forest).
    """
    depth_max = max(d for _, _, d in group_sizes)
    steps: list[int] = []
    groups: list[int] = []
    edges: list[tuple[int, int, float, bool]] = []
    samples: list[int] = []

    def node(step: int, g: int) -> int:
        steps.append(step)
        groups.append(g)
        return len(steps) - 1

    for g, (trees, k, depth) in enumerate(group_sizes):
        for _ in range(trees):
            trunk = node(1, g)
            edges.append((node(0, g), trunk, float("nan"), False))
            frontier = [trunk]
            for level in range(depth):
                nxt = []
                for parent in frontier:
                    for _ in range(k):
                        child = node(2 + level, g)
                        logp = float(torch.randn((), generator=gen)) - 5.0
                        edges.append((parent, child, logp, True))
                        nxt.append(child)
                frontier = nxt
            for parent in frontier:
                leaf = node(2 + depth_max, g)
                edges.append((parent, leaf, float("nan"), False))
                samples.append(leaf)
    n, e, s = len(steps), len(edges), len(samples)
    node_perm = torch.randperm(n, generator=shuffle) if shuffle else torch.arange(n)  # new id -> old id
    edge_perm = torch.randperm(e, generator=shuffle) if shuffle else torch.arange(e)
    sample_perm = torch.randperm(s, generator=shuffle) if shuffle else torch.arange(s)
    new_id = torch.empty(n, dtype=torch.long)
    new_id[node_perm] = torch.arange(n)
    parent, child, logp, train = (list(c) for c in zip(*edges, strict=True))
    ep = edge_perm.tolist()
    num_groups = len(group_sizes)
    rollout = Rollout(
        prompts=[f"prompt {g}" for g in range(num_groups)],
        metadata=[{} for _ in range(num_groups)],
        sigmas=torch.linspace(1, 0, depth_max + 3),
        states=torch.zeros(n, 1),
        node_step=torch.tensor(steps)[node_perm],
        node_group=torch.tensor(groups)[node_perm],
        edge_parent=new_id[torch.tensor(parent)[ep]],
        edge_child=new_id[torch.tensor(child)[ep]],
        old_log_probs=torch.tensor(logp, dtype=torch.float64)[ep],
        trainable=torch.tensor(train)[ep],
        edge_kernel=(~torch.tensor(train)[ep]).long(),
        kernels=["flow-sde", "ode"],
        sample_node=new_id[torch.tensor(samples)[sample_perm]],
        sample_group=torch.tensor(groups)[torch.tensor(samples)[sample_perm]],
        media=torch.zeros(s, 1, 2, 2, 3, dtype=torch.uint8),
    )
    return Forest(rollout, sample_perm, edge_perm)


CHAIN_GROUPS = {2: (2, 1, 2), 12: (12, 1, 2), 27: (27, 1, 2)}  # size -> (chains, 1, trainable steps)
TREE_GROUPS = {2: (1, 2, 1), 12: (3, 2, 2), 27: (1, 3, 3)}  # size -> (trees, k, depth)


# ------------------------------------------------------------------------------------------ estimators
@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[int], AdvantageEstimator]  # group size -> fresh estimator
    shapes: dict[int, tuple[int, int, int]]
    mixes: bool  # combines several sources by z-scoring each (advantage mode), not only their weighted sum


def _ddpo(size: int) -> AdvantageEstimator:
    # buffer_size = min_count = group size: each prompt is normalised by its own rewards of the step (the buffer).
    return PerPromptStatTracker(buffer_size=size, min_count=size)


ESTIMATORS = [
    Case("group-zscore", lambda _: GroupZScoreAdvantage(), CHAIN_GROUPS, True),
    Case("group-zscore-reward-mix", lambda _: GroupZScoreAdvantage(mix="reward"), CHAIN_GROUPS, False),
    Case("group-zscore-global-std", lambda _: GroupZScoreAdvantage(global_std=True), CHAIN_GROUPS, True),
    Case(
        "group-zscore-global-std-reward-mix",
        lambda _: GroupZScoreAdvantage(global_std=True, mix="reward"),
        CHAIN_GROUPS,
        False,
    ),
    Case("tree-backup-softmax", lambda _: TreeBackupAdvantage(), TREE_GROUPS, True),
    Case("tree-backup-uniform", lambda _: TreeBackupAdvantage(weights="uniform"), TREE_GROUPS, True),
    Case("tree-backup-reward-mix", lambda _: TreeBackupAdvantage(multi_reward="reward"), TREE_GROUPS, False),
    Case("leaf-zscore-sum", lambda _: LeafZScoreAdvantage(), TREE_GROUPS, True),
    Case("leaf-zscore-mean", lambda _: LeafZScoreAdvantage(aggregate="mean"), TREE_GROUPS, True),
    Case("ddpo-per-prompt", _ddpo, CHAIN_GROUPS, False),
]
IDS = [c.name for c in ESTIMATORS]
SIZES = [2, 12, 27]


def scores(**sources: Tensor) -> RewardScores:
    weights = dict(zip(sources, [0.8, 0.2, 0.5], strict=False))
    return RewardScores({k: v.float() for k, v in sources.items()}, weights)


def run(case: Case, f: Forest, table: RewardScores, size: int) -> Advantages:
    return case.make(size).estimate(f.rollout, table)


def varied(groups: Tensor, gen: torch.Generator) -> Tensor:
    """Rewards with a clear spread in every group: a shuffled even grid on [0, 1] plus jitter (group std >= 0.28)."""
    out = torch.empty(groups.shape[0], dtype=torch.float64)
    for g in groups.unique():
        rows = (groups == g).nonzero().flatten()
        m = rows.numel()
        jitter = torch.rand(m, generator=gen, dtype=torch.float64) / (4 * m)
        grid = torch.linspace(0, 1, m, dtype=torch.float64) + jitter
        out[rows] = grid[torch.randperm(m, generator=gen)]
    return out


def jpeg_like(n: int, gen: torch.Generator) -> float:
    """A JPEG size in kB as the jpeg reward reports it (bytes / 1000), negated as jpeg-compressibility does."""
    return -int(torch.randint(600, 9000, (1,), generator=gen)) / 1000.0


# ------------------------------------------------------------------------------------- 1. exact zeros
def _constant_cases() -> list[tuple[float | str, int]]:
    return [*itertools.product([*INEXACT, *EXACT, "jpeg"], SIZES)]


@pytest.mark.parametrize("case", ESTIMATORS, ids=IDS)
@pytest.mark.parametrize(("value", "size"), _constant_cases())
def test_constant_groups_give_exact_zero(case: Case, value: float | str, size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    f = forest([case.shapes[size]] * 3, gen)
    n = f.rollout.num_samples
    const = jpeg_like(n, gen) if value == "jpeg" else float(value)
    # every group at the same constant, then each group at its own (still constant within the group)
    per_group = torch.tensor([const, const + 0.1, const * 3.0], dtype=torch.float64)
    for rewards in (torch.full((n,), const, dtype=torch.float64), per_group[f.rollout.sample_group]):
        out = run(case, f, scores(r=rewards), size)
        assert torch.count_nonzero(out.samples) == 0, (case.name, const, out.samples.abs().max())
        assert torch.count_nonzero(out.edges) == 0, (case.name, const, out.edges.abs().max())


@pytest.mark.parametrize("case", ESTIMATORS, ids=IDS)
@pytest.mark.parametrize("size", SIZES)
def test_constant_group_next_to_varied_ones_is_exactly_zero(case: Case, size: int) -> None:
    """One constant prompt among varied ones: its samples and edges are exactly 0, the others are not."""
    gen = torch.Generator().manual_seed(100 + size)
    f = forest([case.shapes[size]] * 4, gen)
    r = f.rollout
    rewards = varied(r.sample_group, gen)
    flat = r.sample_group == 2
    rewards[flat] = 0.3
    second = varied(r.sample_group, gen)
    second[flat] = jpeg_like(1, gen)  # a second source, constant on the same prompt
    for table in (scores(r=rewards), scores(hps=rewards, clip=second)):
        out = run(case, f, table, size)
        assert torch.count_nonzero(out.samples[flat]) == 0, case.name
        assert torch.count_nonzero(out.edges[r.node_group[r.edge_child] == 2]) == 0, case.name
        assert float(out.samples[~flat].abs().max()) > 0.1  # the varied prompts do get advantages
        if case.name.startswith(("group-zscore", "tree-backup")):
            assert out.metrics["adv/zero_std_frac"] == pytest.approx(1 / 4)


@pytest.mark.parametrize("case", [c for c in ESTIMATORS if c.mixes], ids=[c.name for c in ESTIMATORS if c.mixes])
def test_a_constant_source_contributes_nothing(case: Case) -> None:
    """In ``advantage`` mode a source that is constant on every prompt adds exactly 0 to the weighted sum."""
    gen = torch.Generator().manual_seed(5)
    f = forest([case.shapes[12]] * 3, gen)
    rewards = varied(f.rollout.sample_group, gen)
    both = run(case, f, scores(hps=rewards, clip=torch.full_like(rewards, 0.999)), 12)
    alone = run(case, f, RewardScores({"hps": rewards.float()}, {"hps": 0.8}), 12)
    torch.testing.assert_close(both.samples, alone.samples, rtol=0, atol=PROPERTY_ATOL)
    torch.testing.assert_close(both.edges, alone.edges, rtol=0, atol=PROPERTY_ATOL)


# ------------------------------------------------------------------------------------ 2. permutation
@pytest.mark.parametrize("case", ESTIMATORS, ids=IDS)
@pytest.mark.parametrize("seed", range(3))
def test_storage_order_permutes_advantages(case: Case, seed: int) -> None:
    """Same forest, nodes / edges / samples stored in another order: the advantages follow their samples and edges."""
    size = SIZES[seed]
    shapes = [case.shapes[s] for s in (size, 12, size)]
    canon = forest(shapes, torch.Generator().manual_seed(seed))
    mixed = forest(shapes, torch.Generator().manual_seed(seed), shuffle=torch.Generator().manual_seed(50 + seed))
    gen = torch.Generator().manual_seed(200 + seed)
    hps, clip = varied(canon.rollout.sample_group, gen), varied(canon.rollout.sample_group, gen)
    hps[canon.rollout.sample_group == 1] = 0.7  # one constant prompt as well
    # DDPO's FIFO buffer must hold a whole group, else which rewards it keeps depends on the order by design.
    ref = run(case, canon, scores(hps=hps, clip=clip), max(size, 12))
    out = run(case, mixed, scores(hps=hps[mixed.sample_of], clip=clip[mixed.sample_of]), max(size, 12))
    torch.testing.assert_close(out.samples, ref.samples[mixed.sample_of], rtol=0, atol=PROPERTY_ATOL)
    torch.testing.assert_close(out.edges, ref.edges[mixed.edge_of], rtol=0, atol=PROPERTY_ATOL)
    assert float(ref.samples.abs().max()) > 0.1  # the comparison is not between zeros


# --------------------------------------------------------------------------------- 3. affine invariance
AFFINE = [(0.5, 0.0), (3.0, -2.0), (0.25, 7.5), (4.0, 0.3), (2.0, -17.0)]


@pytest.mark.parametrize("case", ESTIMATORS, ids=IDS)
@pytest.mark.parametrize(("a", "b"), AFFINE)
@pytest.mark.parametrize("size", SIZES)
def test_positive_affine_change_of_rewards_keeps_advantages(case: Case, a: float, b: float, size: int) -> None:
    gen = torch.Generator().manual_seed(int(10 * a) + size)
    f = forest([case.shapes[size]] * 3, gen)
    hps, clip = 0.2 + varied(f.rollout.sample_group, gen), 5.0 + 3.0 * varied(f.rollout.sample_group, gen)
    ref = run(case, f, scores(hps=hps, clip=clip), size)
    if case.mixes:  # each source normalised on its own: any positive affine map per source
        moved = scores(hps=a * hps + b, clip=(a + 1.0) * clip - b)
    else:  # the weighted sum is normalised: a common scale, any shifts
        moved = scores(hps=a * hps + b, clip=a * clip - 2.0 * b)
    out = run(case, f, moved, size)
    torch.testing.assert_close(out.samples, ref.samples, rtol=0, atol=PROPERTY_ATOL)
    torch.testing.assert_close(out.edges, ref.edges, rtol=0, atol=PROPERTY_ATOL)


def test_affine_tolerance_catches_an_unnormalised_estimator() -> None:
    """The tolerance above is tight enough to see a z-score without its std (or its mean) under these maps."""
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(27 * 3, generator=gen, dtype=torch.float64)
    groups = torch.arange(3).repeat_interleave(27)
    for a, b in AFFINE[1:]:
        z = group_zscore(values, groups)
        moved = (a * values + b).float()
        assert (group_zscore(moved, groups) - z).abs().max() <= PROPERTY_ATOL  # the real estimator passes
        no_std = group_zscore(moved, groups) * moved.double().std() / values.std()  # "forgot to divide"
        no_mean = group_zscore(moved, groups) + b / values.std()  # "forgot to centre"
        assert (no_std - z).abs().max() > 100 * PROPERTY_ATOL
        assert (no_mean - z).abs().max() > 100 * PROPERTY_ATOL


# --------------------------------------------------------------------------------- the shared z-score
@pytest.mark.parametrize("value", INEXACT)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("global_std", [False, True])
def test_group_zscore_constant_group_is_zero_even_with_zero_eps(value: float, size: int, global_std: bool) -> None:
    values = torch.cat([torch.full((size,), value), torch.linspace(0, 1, size)])
    groups = torch.cat([torch.full((size,), 7), torch.full((size,), 3)])  # non-contiguous ids
    for eps in (1e-8, 0.0):
        out = group_zscore(values, groups, eps=eps, global_std=global_std)
        assert out.dtype == torch.float32 and torch.count_nonzero(out[:size]) == 0
        assert bool(torch.isfinite(out).all())


def test_group_zscore_global_std_matches_flow_grpo() -> None:
    """Flow-GRPO ``global_std``: per-prompt mean, population std of all rewards of the step."""
    gen = torch.Generator().manual_seed(3)
    values = torch.rand(24, generator=gen)
    groups = torch.arange(24) % 4
    out = group_zscore(values, groups, eps=0.0, global_std=True)
    v = values.double()
    for k in range(4):
        expected = (v[groups == k] - v[groups == k].mean()) / v.std(unbiased=False)
        torch.testing.assert_close(out[groups == k].double(), expected, rtol=1e-6, atol=1e-6)
