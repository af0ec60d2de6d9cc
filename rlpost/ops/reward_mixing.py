"""Multi-reward mixing: per-group z-scores and the two aggregation orders.

* ``"reward"`` mode: ``A = zscore_g(Σ_k w_k R_k)``: sum raw rewards, then normalise per prompt group (Flow-GRPO's
  ``multi_score`` weighted ``avg``; the HPS:CLIP 0.7:1.4 of XueZeyue/DanceGRPO issue #19 is a raw-reward weighting).
* ``"advantage"`` mode: ``A = Σ_k w_k zscore_g(R_k)``: normalise each reward per group, then weight (MixGRPO's
  ``advantage_aggr`` in ``Tencent-Hunyuan/MixGRPO`` ``fastvideo/train_grpo_flux.py``@e5cdd6a, and TreeGRPO, arXiv
  2512.08153, Sec. "Experiments": 0.8 HPS : 0.2 CLIP). Rewards on very different scales (aesthetic
  ≈ 6, CLIP cosine ≈ 0.38) contribute by their weights rather than by their spread.

Weights are used as given (not renormalised). Estimators written by others call these functions.
"""

from __future__ import annotations

import difflib
import math
from typing import Literal

import torch
from torch import Tensor

from rlpost.core.contract import RewardScores

__all__ = ["constant_groups", "group_std", "group_zscore", "mix_rewards", "validate_reward_weights"]


def constant_groups(values: Tensor, groups: Tensor) -> Tensor:
    """``[S]`` bool, True for samples whose group's ``values`` are all equal (a group of one included).

    Args:
        values: ``[S]`` values.
        groups: ``[S]`` integer group id of each value.
    """
    if values.ndim != 1 or groups.shape != values.shape:
        raise ValueError(f"constant_groups: values {tuple(values.shape)} and groups {tuple(groups.shape)} must be [S]")
    v = values.detach().double()
    _, inverse = torch.unique(groups.to(v.device), return_inverse=True)
    num = int(inverse.max().item()) + 1 if inverse.numel() else 0
    hi = torch.full((num,), -math.inf, dtype=v.dtype, device=v.device).scatter_reduce(0, inverse, v, "amax")
    lo = torch.full((num,), math.inf, dtype=v.dtype, device=v.device).scatter_reduce(0, inverse, v, "amin")
    return (hi == lo)[inverse]


def group_zscore(
    values: Tensor, groups: Tensor, eps: float = 1e-8, unbiased: bool = True, global_std: bool = False
) -> Tensor:
    """Standardise ``values`` within each group: ``(v - mean_g) / (std_g + eps)``.

    As DanceGRPO (``XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py@15cc71d``: unbiased ``torch.std``, eps 1e-8);
    ``global_std`` is Flow-GRPO's variant (``yifan123/flow_grpo flow_grpo/stat_tracking.py@ac4c86e``: group mean,
    ``np.std`` of all rewards).

    A group whose values are all equal (a group of one included) gets exactly 0, never NaN and never amplified
    rounding noise. This matters because the usual float32 formula does not give 0 for such a group when the value
    is not representable exactly: 27 leaves that all score 0.3 have a float32 mean that differs from 0.3 by an ulp,
    so both ``v - mean`` and the std are ~1e-8 and their ratio is of order 1 — a full-size advantage from nothing.
    The statistics are therefore computed in float64 on values shifted by their group minimum (so a constant group
    centres to exactly 0 and the shift loses nothing), and constant groups are set to 0 explicitly (which also
    covers ``eps = 0``). Every estimator that normalises per group inherits this.

    Args:
        values: ``[S]`` values.
        groups: ``[S]`` integer group id of each value (any ids, not necessarily contiguous).
        eps: Added to the standard deviation.
        unbiased: Use the ``n - 1`` (Bessel) standard deviation, as ``torch.std`` does by default.
        global_std: Divide by the population (ddof 0, ``np.std``) standard deviation of *all* values instead of the
            group's (Flow-GRPO's ``global_std``); the mean is still the group's. ``unbiased`` is then ignored.

    Returns:
        ``[S]`` fp32 z-scores.
    """
    if values.ndim != 1 or groups.shape != values.shape:
        raise ValueError(f"group_zscore: values {tuple(values.shape)} and groups {tuple(groups.shape)} must be [S]")
    v = values.detach().double()
    if v.numel() == 0:
        return v.float()
    _, inverse, centred, std = _group_moments(v, groups, unbiased)
    if global_std:
        rest = v - v.min()
        std = torch.sqrt(((rest - rest.mean()) ** 2).mean()).expand(std.shape[0])
    z = centred / (std[inverse] + eps)
    return torch.where(constant_groups(v, groups), torch.zeros_like(z), z).float()


def _group_moments(v: Tensor, groups: Tensor, unbiased: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sorted unique group ids, each value's group index, values centred on their group mean, and per-group std,
    all in float64 on values shifted by their group minimum (a constant group centres to exactly 0; see
    :func:`group_zscore`)."""
    ids, inverse = torch.unique(groups.to(v.device), return_inverse=True)
    num = ids.shape[0]

    def per_group(x: Tensor) -> Tensor:
        return torch.zeros(num, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)

    lo = torch.full((num,), math.inf, dtype=v.dtype, device=v.device).scatter_reduce(0, inverse, v, "amin")
    shifted = v - lo[inverse]  # exactly 0 across a constant group; float32 inputs subtract exactly in float64
    counts = per_group(torch.ones_like(v))
    centred = shifted - (per_group(shifted) / counts)[inverse]
    denom = (counts - 1.0).clamp_min(1.0) if unbiased else counts
    return ids, inverse, centred, torch.sqrt(per_group(centred * centred) / denom)


def group_std(values: Tensor, groups: Tensor, unbiased: bool = False) -> tuple[Tensor, Tensor]:
    """Per-group standard deviation of ``values``, computed as :func:`group_zscore` computes it (float64, a constant
    group gives exactly 0).

    Returns:
        ``(ids, std)``: the sorted unique group ids and the ``[len(ids)]`` float64 standard deviation of each.
    """
    if values.ndim != 1 or groups.shape != values.shape:
        raise ValueError(f"group_std: values {tuple(values.shape)} and groups {tuple(groups.shape)} must be [S]")
    ids, _, _, std = _group_moments(values.detach().double(), groups, unbiased)
    return ids, std


def mix_rewards(
    scores: RewardScores,
    groups: Tensor,
    mode: Literal["advantage", "reward"] = "advantage",
    eps: float = 1e-8,
    global_std: bool = False,
    unbiased: bool = True,
) -> Tensor:
    """Combine per-source rewards into one per-sample, group-normalised signal.

    Args:
        scores: Per-source ``[S]`` scores and recipe weights.
        groups: ``[S]`` prompt-group id of each sample.
        mode: ``"reward"``: z-score of the weighted sum of raw rewards; ``"advantage"``: weighted sum of the
            per-reward z-scores.
        eps: Added to each group's standard deviation.
        global_std: Divide by the std of all values of the step instead of the group's (see :func:`group_zscore`).
        unbiased: Bessel-corrected (``n - 1``) group std, as ``torch.std``; ``False`` for the population std.

    Returns:
        ``[S]`` fp32 mixed values; exactly 0 for a group in which every reward source is constant.
    """
    if not scores.scores:
        raise ValueError("mix_rewards: RewardScores holds no reward source")
    if mode == "reward":
        return group_zscore(scores.weighted_sum(), groups, eps=eps, unbiased=unbiased, global_std=global_std)
    if mode == "advantage":
        total: Tensor | None = None
        for name, value in scores.scores.items():
            term = scores.weights[name] * group_zscore(value, groups, eps=eps, unbiased=unbiased, global_std=global_std)
            total = term if total is None else total + term
        assert total is not None
        return total
    raise ValueError(f"mix_rewards: mode must be 'advantage' or 'reward', got {mode!r}")


def validate_reward_weights(weights: dict[str, float], known: set[str]) -> list[str]:
    """Problems with a recipe's ``reward_weights`` (empty list when fine).

    Reports unknown reward names (with a did-you-mean suggestion), negative or non-finite weights, and all-zero
    weights (which would silently train on nothing; XueZeyue/DanceGRPO issues #13 and #19, huggingface/trl PR #2676).

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
