from __future__ import annotations

import math

import pytest
import torch

from rlpost.core.contract import RewardScores
from rlpost.ops.reward_mixing import group_zscore, mix_rewards, validate_reward_weights


def _z(xs: list[float]) -> list[float]:
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return [(x - mean) / (std + 1e-8) for x in xs]


def test_group_zscore_hand_values() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 7.0])
    groups = torch.tensor([5, 5, 5, 2, 2, 9])  # non-contiguous ids, a constant group, a singleton
    out = group_zscore(values, groups)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    biased = group_zscore(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), unbiased=False)
    torch.testing.assert_close(biased, torch.tensor([-1.0, 1.0]))
    assert torch.isfinite(out).all()


def test_group_zscore_matches_torch_std_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(24, generator=g)
    groups = torch.arange(24) % 4
    out = group_zscore(values, groups, eps=0.0)
    for k in range(4):
        v = values[groups == k]
        torch.testing.assert_close(out[groups == k], (v - v.mean()) / v.std())


def test_mix_modes_hand_computed() -> None:
    hps = [0.25, 0.30, 0.35, 0.20, 0.40, 0.30]
    clip = [0.36, 0.38, 0.34, 0.40, 0.38, 0.39]
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    scores = RewardScores(
        scores={"hps-v2.1": torch.tensor(hps), "clipscore": torch.tensor(clip)},
        weights={"hps-v2.1": 0.8, "clipscore": 0.2},
    )
    # advantage mode (TreeGRPO 0.8 HPS : 0.2 CLIP): weighted sum of per-group z-scores
    expected_adv = []
    for lo in (0, 3):
        zh, zc = _z(hps[lo : lo + 3]), _z(clip[lo : lo + 3])
        expected_adv += [0.8 * a + 0.2 * b for a, b in zip(zh, zc, strict=True)]
    torch.testing.assert_close(mix_rewards(scores, groups, "advantage"), torch.tensor(expected_adv))
    # reward mode: z-score of the weighted raw sum
    raw = [0.8 * a + 0.2 * b for a, b in zip(hps, clip, strict=True)]
    expected_rew = _z(raw[:3]) + _z(raw[3:])
    torch.testing.assert_close(mix_rewards(scores, groups, "reward"), torch.tensor(expected_rew))
    assert not torch.allclose(mix_rewards(scores, groups, "reward"), mix_rewards(scores, groups, "advantage"))
    with pytest.raises(ValueError, match="mode"):
        mix_rewards(scores, groups, "bogus")  # type: ignore[arg-type]


def test_validate_reward_weights() -> None:
    known = {"hps-v2.1", "clipscore", "aesthetic"}
    assert validate_reward_weights({"hps-v2.1": 0.8, "clipscore": 0.2}, known) == []
    problems = validate_reward_weights({"hps-v2": 1.0}, known)
    assert len(problems) == 1 and "unknown reward 'hps-v2'" in problems[0] and "did you mean 'hps-v2.1'" in problems[0]
    assert any("all weights are zero" in p for p in validate_reward_weights({"hps-v2.1": 0.0, "clipscore": 0.0}, known))
    assert any("negative" in p for p in validate_reward_weights({"aesthetic": -1.0, "clipscore": 1.0}, known))
    assert any("finite" in p for p in validate_reward_weights({"aesthetic": float("nan")}, known))
    assert validate_reward_weights({}, known)
