"""group-zscore: per-group standardisation, zero-spread groups, multi-reward mixing, broadcast to chain edges."""

from __future__ import annotations

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.components.chain import edge_sample_ids, node_sample_ids
from rlpost.components.group_zscore import GroupZScoreAdvantage
from rlpost.core.contract import PromptBatch, RewardScores
from rlpost.ops.sampling import RolloutBuilder
from tests.unit.components.chain_helpers import chain_rollout


def scores(**named: list[float]) -> RewardScores:
    return RewardScores({k: torch.tensor(v) for k, v in named.items()}, {k: 1.0 for k in named})


def test_mean_zero_std_one_per_group() -> None:
    torch.manual_seed(0)
    trainable = torch.ones(8, 3, dtype=torch.bool)
    rollout = chain_rollout(2, 4, 3, trainable)
    rewards = [1.0, 2.0, 4.0, 7.0, -3.0, 0.5, 0.25, 10.0]
    adv = GroupZScoreAdvantage().estimate(rollout, scores(r=rewards))
    for g in range(2):
        a = adv.samples[rollout.sample_group == g]
        assert abs(float(a.mean())) < 1e-6
        assert abs(float(a.std(unbiased=True)) - 1.0) < 1e-6  # DanceGRPO: unbiased torch.std
    expected = (torch.tensor(rewards[:4]) - 3.5) / torch.tensor(rewards[:4]).std()
    torch.testing.assert_close(adv.samples[:4], expected)
    assert adv.metrics["adv/zero_std_frac"] == 0.0


def test_zero_std_group_gets_exact_zero() -> None:
    rollout = chain_rollout(3, 3, 2, torch.ones(9, 2, dtype=torch.bool))
    # group 0 constant (values whose mean is inexact in fp32), group 1 varies, group 2 constant
    rewards = [0.1, 0.1, 0.1, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0]
    adv = GroupZScoreAdvantage().estimate(rollout, scores(r=rewards))
    assert torch.equal(adv.samples[[0, 1, 2, 6, 7, 8]], torch.zeros(6))
    assert torch.equal(adv.edges[edge_sample_ids(rollout) < 3], torch.zeros(6))
    torch.testing.assert_close(adv.samples[3:6], torch.tensor([-1.0, 0.0, 1.0]))
    assert adv.metrics["adv/zero_std_frac"] == pytest.approx(2 / 3)


def test_edges_get_their_sample_advantage_and_untrainable_edges_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    trainable = torch.rand(6, 4, generator=gen) < 0.5
    trainable[0] = False  # a sample with no trainable edge at all
    rollout = chain_rollout(2, 3, 4, trainable)
    adv = GroupZScoreAdvantage().estimate(rollout, scores(r=[3.0, 1.0, 2.0, 9.0, 4.0, 8.0]))
    owner = edge_sample_ids(rollout)
    assert (owner >= 0).all()
    assert torch.equal(torch.bincount(owner, minlength=6), torch.full((6,), 4))  # every chain has T edges
    # the node -> sample walk agrees with how the chains were built (sample s is row s at every step)
    steps = rollout.node_step[rollout.edge_child]
    for e in range(rollout.num_edges):
        s = int(owner[e])
        assert bool(rollout.trainable[e]) == bool(trainable[s, int(steps[e]) - 1])
        expected = float(adv.samples[s]) if rollout.trainable[e] else 0.0
        assert float(adv.edges[e]) == expected
    assert adv.metrics["adv/trainable_edges"] == float(trainable.sum())


def test_global_std_and_multi_reward_modes() -> None:
    rollout = chain_rollout(2, 2, 1, torch.ones(4, 1, dtype=torch.bool))
    r = torch.tensor([1.0, 3.0, 10.0, 14.0])
    adv = GroupZScoreAdvantage(global_std=True).estimate(rollout, scores(r=r.tolist()))
    centred = torch.tensor([-1.0, 1.0, -2.0, 2.0])
    torch.testing.assert_close(adv.samples, centred / (r.std(unbiased=False) + 1e-8))

    two = RewardScores(
        {"a": torch.tensor([1.0, 3.0, 0.0, 1.0]), "b": torch.tensor([10.0, 0.0, 5.0, 5.0])}, {"a": 2.0, "b": 1.0}
    )
    by_adv = GroupZScoreAdvantage(mix="advantage").estimate(rollout, two).samples
    z = 1 / torch.tensor([1.0, 3.0]).std()  # z-score magnitude of a pair
    torch.testing.assert_close(by_adv, torch.stack([2 * -z + z, 2 * z - z, 2 * -z + 0, 2 * z + 0]))
    by_reward = GroupZScoreAdvantage(mix="reward").estimate(rollout, two).samples
    # weighted sums 12, 6 | 5, 7 -> z-scores +z, -z | -z, +z
    torch.testing.assert_close(by_reward, torch.stack([z, -z, -z, z]))


def test_tree_rollouts_are_rejected() -> None:
    batch = PromptBatch(["p"], [{}], 2)
    builder = RolloutBuilder(batch, torch.linspace(1, 0, 2), ["flow-sde"])
    root = builder.add_nodes(torch.zeros(1, 1), 0, torch.zeros(1))
    kids = builder.add_nodes(torch.zeros(2, 1), 1, torch.zeros(2))
    builder.add_edges(root.repeat(2), kids, torch.zeros(2), True, 0)
    rollout = builder.build(kids, torch.zeros(2, 1, 2, 2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="tree"):
        node_sample_ids(rollout)


def test_registered_as_core_component() -> None:
    host = build_host(load_entrypoints=False)
    assert host.registry("advantage").get("group-zscore").cls is GroupZScoreAdvantage
