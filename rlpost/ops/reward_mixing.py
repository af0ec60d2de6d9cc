"""Multi-reward mixing: per-group z-scores and the two aggregation orders.

* ``"reward"`` mode: ``A = zscore_g(Σ_k w_k R_k)``: sum raw rewards, then normalise per prompt group (Flow-GRPO's
  ``multi_score`` weighted ``avg``; DanceGRPO issue #19's HPS:CLIP 0.7:1.4 is a raw-reward weighting).
* ``"advantage"`` mode: ``A = Σ_k w_k zscore_g(R_k)``: normalise each reward per group, then weight (MixGRPO and
  TreeGRPO, the latter with 0.8 HPS : 0.2 CLIP; algorithms.md 8.6). Rewards on very different scales (aesthetic
  ≈ 6, CLIP cosine ≈ 0.38) contribute by their weights rather than by their spread.

Weights are used as given (not renormalised). Estimators written by others call these functions.
"""

from __future__ import annotations

import difflib
import math
from typing import Literal

import torch
from torch import Tensor

from rlpost.contract import RewardScores

__all__ = ["group_zscore", "mix_rewards", "validate_reward_weights"]


def group_zscore(values: Tensor, groups: Tensor, eps: float = 1e-8, unbiased: bool = True) -> Tensor:
    """Standardise ``values`` within each group: ``(v - mean_g) / (std_g + eps)`` (algorithms.md 1.4).

    A group of one sample (or a group whose values are all equal) gets zero, never NaN.

    Args:
        values: ``[S]`` values.
        groups: ``[S]`` integer group id of each value (any ids, not necessarily contiguous).
        eps: Added to the standard deviation.
        unbiased: Use the ``n - 1`` (Bessel) standard deviation, as ``torch.std`` does by default.

    Returns:
        ``[S]`` fp32 z-scores.
    """
    if values.ndim != 1 or groups.shape != values.shape:
        raise ValueError(f"group_zscore: values {tuple(values.shape)} and groups {tuple(groups.shape)} must be [S]")
    v = values.float()
    _, inverse = torch.unique(groups.to(v.device), return_inverse=True)
    num = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num, dtype=v.dtype, device=v.device).index_add_(0, inverse, torch.ones_like(v))
    sums = torch.zeros(num, dtype=v.dtype, device=v.device).index_add_(0, inverse, v)
    mean = sums / counts
    centred = v - mean[inverse]
    sq = torch.zeros(num, dtype=v.dtype, device=v.device).index_add_(0, inverse, centred * centred)
    denom = (counts - 1.0).clamp_min(1.0) if unbiased else counts
    std = torch.sqrt(sq / denom)
    std = torch.where(counts > 1, std, torch.zeros_like(std))
    return centred / (std[inverse] + eps)


def mix_rewards(
    scores: RewardScores,
    groups: Tensor,
    mode: Literal["advantage", "reward"] = "advantage",
    eps: float = 1e-8,
) -> Tensor:
    """Combine per-source rewards into one per-sample, group-normalised signal.

    Args:
        scores: Per-source ``[S]`` scores and recipe weights.
        groups: ``[S]`` prompt-group id of each sample.
        mode: ``"reward"``: z-score of the weighted sum of raw rewards; ``"advantage"``: weighted sum of the
            per-reward z-scores.
        eps: Added to each group's standard deviation.

    Returns:
        ``[S]`` fp32 mixed values.
    """
    if not scores.scores:
        raise ValueError("mix_rewards: RewardScores holds no reward source")
    if mode == "reward":
        return group_zscore(scores.weighted_sum(), groups, eps=eps)
    if mode == "advantage":
        total: Tensor | None = None
        for name, value in scores.scores.items():
            term = scores.weights[name] * group_zscore(value, groups, eps=eps)
            total = term if total is None else total + term
        assert total is not None
        return total
    raise ValueError(f"mix_rewards: mode must be 'advantage' or 'reward', got {mode!r}")


def validate_reward_weights(weights: dict[str, float], known: set[str]) -> list[str]:
    """Problems with a recipe's ``reward_weights`` (empty list when fine).

    Reports unknown reward names (with a did-you-mean suggestion), negative or non-finite weights, and all-zero
    weights (which would silently train on nothing; DanceGRPO #13/#19, trl PR #2676).

    Args:
        weights: Reward name -> weight from the recipe.
        known: Names of the reward sources the recipe configures (or the registry knows).
    """
    problems: list[str] = []
    if not weights:
        return ["reward_weights is empty: configure at least one reward with a positive weight"]
    for name, weight in weights.items():
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known rewards: {sorted(known)}"
            problems.append(f"reward_weights: unknown reward {name!r}{hint}")
        if not math.isfinite(weight):
            problems.append(f"reward_weights: weight of {name!r} is {weight}, expected a finite number")
        elif weight < 0:
            problems.append(
                f"reward_weights: weight of {name!r} is negative ({weight}); to minimise a reward use a reward "
                "source that negates it (e.g. jpeg-compressibility) rather than a negative weight"
            )
    if all(math.isfinite(w) and w == 0 for w in weights.values()):
        problems.append("reward_weights: all weights are zero, so every advantage would be zero")
    return problems
