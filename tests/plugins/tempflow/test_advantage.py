"""Per-(prompt, branch step) normalisation against a numpy restatement of upstream's per-prompt stat tracker on the
``[children, steps]`` reward matrix."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rlpost.core.contract import PromptBatch, RewardScores
from rlpost_tempflow.advantage import TempFlowAdvantage
from rlpost_tempflow.sampler import TempFlowSampler


@pytest.fixture(scope="module")
def comb(tiny_sd3_dir: Any) -> Any:
    from rlpost.models import SD3Policy

    policy = SD3Policy(str(tiny_sd3_dir), dtype="float32", resolution=32, guidance_scale=1.0, max_sequence_length=32)
    policy.setup(torch.device("cpu"))
    sampler = TempFlowSampler(num_steps=4, k=3, trunks_per_prompt=2)
    batch = PromptBatch(["a red cube", "a blue sphere"], [{}, {}], 1, group_offset=5)
    with torch.no_grad():
        return sampler.rollout(policy, batch, torch.Generator().manual_seed(0))


def expected(rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """``rewards`` ``[G, steps, trunks·k]``: (r - mean over the prompt's row at that step) / (std + 1e-4), np.std."""
    mean = rewards.mean(axis=2, keepdims=True)
    if global_std:
        std = rewards.transpose(1, 0, 2).reshape(rewards.shape[1], -1).std(axis=1)[None, :, None]
    else:
        std = rewards.std(axis=2, keepdims=True)
    return (rewards - mean) / (std + 1e-4)


def edge_sample(rollout: Any) -> dict[int, int]:
    """Each trainable edge's sample, by following single-child edges down (independent of the estimator)."""
    child_of = {int(p): int(c) for p, c in zip(rollout.edge_parent, rollout.edge_child, strict=True)}
    where = {int(n): i for i, n in enumerate(rollout.sample_node.tolist())}
    out = {}
    for e in rollout.trainable.nonzero().flatten().tolist():
        node = int(rollout.edge_child[e])
        while node not in where:
            node = child_of[node]
        out[e] = where[node]
    return out


@pytest.mark.parametrize("global_std", [False, True])
def test_normalised_per_prompt_and_step(comb: Any, global_std: bool) -> None:
    g, steps, per = 2, 3, 2 * 3  # groups, branch steps, trunks·k children per (prompt, step)
    assert comb.num_samples == g * steps * per
    rng = np.random.default_rng(0)
    # Give each step its own scale so a per-prompt-only (not per-step) normalisation would fail.
    raw = rng.normal(size=(g, steps, per)) * np.array([3.0, 1.0, 0.1])[None, :, None] + np.arange(steps)[None, :, None]
    # The sampler orders samples by group, branch step, trunk, child.
    scores = RewardScores({"r": torch.tensor(raw.reshape(-1), dtype=torch.float32)}, {"r": 1.0})
    adv = TempFlowAdvantage(global_std=global_std).estimate(comb, scores)
    want = expected(raw, global_std).reshape(-1)
    np.testing.assert_allclose(adv.samples.numpy(), want, rtol=1e-4, atol=1e-4)
    # Every branch edge carries its own child's advantage; every other edge 0.
    for e, s in edge_sample(comb).items():
        assert float(adv.edges[e]) == pytest.approx(want[s], rel=1e-4, abs=1e-4)
    assert float(adv.edges[~comb.trainable].abs().max()) == 0.0


def test_sample_order_matches_branch_steps(comb: Any) -> None:
    from rlpost_tempflow.advantage import sample_branch_steps

    steps = sample_branch_steps(comb).view(2, 3, 6)
    assert steps.tolist() == [[[j] * 6 for j in range(3)]] * 2  # integer step indices


def test_constant_step_column_gives_zero(comb: Any) -> None:
    raw = torch.ones(comb.num_samples)
    adv = TempFlowAdvantage().estimate(comb, RewardScores({"r": raw}, {"r": 1.0}))
    assert float(adv.edges.abs().max()) == 0.0
