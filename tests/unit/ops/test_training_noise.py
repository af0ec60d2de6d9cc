"""Training timesteps and noise of likelihood-free rules (rlpost/ops/training_noise.py): keyed by run seed, step and
rank-independent sample keys, so a split of the groups over ranks draws the same values per sample."""

from __future__ import annotations

import torch

from rlpost.core.contract import Rollout
from rlpost.ops.training_noise import (
    grid_permutations,
    keyed_generator,
    noise_for,
    renoise,
    sample_keys,
    stratified_indices,
    subset_without_replacement,
)


def toy_rollout(groups: int, samples_per_group: int, group_offset: int = 0) -> Rollout:
    """Chains of one clean node per sample (no edges): all sample_keys reads is the sample table."""
    s = groups * samples_per_group
    empty = torch.empty(0, dtype=torch.long)
    return Rollout(
        prompts=[f"p{g}" for g in range(groups)],
        metadata=[{} for _ in range(groups)],
        sigmas=torch.tensor([1.0, 0.0]),
        states=torch.zeros(s, 2),
        node_step=torch.ones(s, dtype=torch.long),
        node_group=torch.arange(groups).repeat_interleave(samples_per_group),
        edge_parent=empty,
        edge_child=empty,
        old_log_probs=torch.empty(0, dtype=torch.float64),
        trainable=torch.empty(0, dtype=torch.bool),
        edge_kernel=empty,
        kernels=[],
        sample_node=torch.arange(s),
        sample_group=torch.arange(groups).repeat_interleave(samples_per_group),
        media=torch.zeros(s, 1, 2, 2, 3, dtype=torch.uint8),
        group_offset=group_offset,
    )


def test_keyed_generator_depends_on_every_key_and_nothing_else():
    a = torch.rand(4, generator=keyed_generator(3, 1, 2))
    assert torch.equal(a, torch.rand(4, generator=keyed_generator(3, 1, 2)))  # a stateless function of its keys
    assert not torch.equal(a, torch.rand(4, generator=keyed_generator(3, 2, 1)))
    assert not torch.equal(a, torch.rand(4, generator=keyed_generator(4, 1, 2)))


def test_sample_keys_are_global_and_rank_independent():
    whole = toy_rollout(groups=4, samples_per_group=3)
    keys = sample_keys(whole)
    assert keys[:4] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert len(set(keys)) == 12
    second_half = toy_rollout(groups=2, samples_per_group=3, group_offset=2)  # what rank 1 of 2 holds
    assert sample_keys(second_half) == keys[6:]


def test_grid_permutations_per_sample_and_rank_independent():
    keys = [(0, 0), (0, 1), (1, 0), (1, 1)]
    perm = grid_permutations(5, 2, keys, num_steps=10, keep=9)
    assert perm.shape == (4, 9)
    for row in perm:
        assert len(set(row.tolist())) == 9 and row.max() < 10
    assert not torch.equal(perm[0], perm[1])
    assert torch.equal(grid_permutations(5, 2, keys[2:], 10, 9), perm[2:])  # the other rank's samples, alone


def test_stratified_indices_follow_awm_strata():
    """Upstream's law (scxue/advantage_weighted_matching ``train_sd3_awm.py`` @be51372 L1197-1205): stratum ``i`` is
    the integers ``⌊b_i⌋ … ⌊b_{i+1}⌋ - 1`` of ``b = linspace(lo, hi, n+1)``, each drawn; ``hi`` never is."""
    cases = {
        (1, 12, 6): [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}],  # discrete_wo_init, 14 steps
        (0, 12, 6): [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}],  # discrete, 14 steps
        (1, 9, 6): [{1}, {2}, {3, 4}, {5}, {6}, {7, 8}],  # discrete_wo_init, 10 steps
        (1, 3, 6): [{1}, {1}, {1}, {2}, {2}, {2}],  # fewer indices than strata: repeats
    }
    for (lo, hi, n), strata in cases.items():
        seen: list[set[int]] = [set() for _ in strata]
        for s in range(200):
            idx = stratified_indices(keyed_generator(s), lo, hi, n)
            assert idx.shape == (n,) and idx.dtype == torch.long
            for i, v in enumerate(idx.tolist()):
                seen[i].add(v)
        assert seen == strata, (lo, hi, n)


def test_subset_without_replacement():
    idx = subset_without_replacement(keyed_generator(1, 2), hi=4, n=4)
    assert len(set(idx.tolist())) == 4 and idx.max() <= 4


def test_noise_and_renoise():
    e1 = noise_for(0, 3, (2, 1), (2, 4))
    assert torch.equal(e1, noise_for(0, 3, (2, 1), (2, 4)))
    assert not torch.equal(e1, noise_for(0, 3, (2, 0), (2, 4)))
    x0 = torch.ones(2, 4)
    sigma = torch.tensor([0.0, 1.0])
    out = renoise(x0, sigma, e1)
    assert torch.allclose(out[0], x0[0], atol=1e-7) and torch.allclose(out[1], e1[1], atol=1e-7)
