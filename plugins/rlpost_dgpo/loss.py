"""DGPO's per-sample loss at one timestep: denoising errors, group preference weights, the PPO-style clip.

Direct Group Preference Optimization (Luo, Hu, Tang, arXiv 2510.08425) trains on a group of samples of one prompt,
split by the sign of their advantage into a preferred and a dispreferred part. The group's implicit reward margin
against a reference is the advantage-weighted sum of the samples' denoising-error differences; the DPO likelihood of
the group preference is ``log σ(-S_g)`` and its gradient reaches each sample's error ``d_i`` with the weight
``σ(S_g)·A_i`` (Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py`` @01ceb4b L162-193). Per timestep, with ``ε`` the
re-noising noise and ``v`` a velocity::

    d_i      = mean_elem((ε − x0_i − v_θ)²)                       (grad)
    d_i^cmp  = mean_elem((ε − x0_i − v_cmp)²)                     (no grad; v_cmp = frozen reference or EMA copy)
    S_g      = Σ_{i∈g} A_i · β_dpo · (d_i − d_i^cmp) / |g|        (detached)
    w_g      = sigmoid(S_g)
    ℓ_i      = sg(w_g) · A_i · d_i

Sign: ``S_g`` is large when the policy denoises its positive samples worse than the comparison model (and its
negatives better); the group's DPO loss ``softplus(S_g) = −log σ(−S_g)`` is then large, and its derivative
``σ(S_g)`` is the weight: a group the policy already orders correctly (``S_g ≪ 0``) gets a weight near 0. Upstream
uses exactly ``sigmoid(S_g)`` (its alternative ``1 − sigmoid`` is commented out, L187-188), which is what this module
computes.

PPO-style clip (upstream L1132-1144): ``ratio_i = exp(−d_i + d_i^old)`` against the EMA copy; a sample with ``A > 0``
is clipped when ``ratio > 1 + c``, one with ``A ≤ 0`` when ``ratio < 1 − c``, and a clipped sample keeps its loss
value but no gradient (``d_i`` detached).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DGPOTerms", "denoising_error", "dgpo_terms", "group_weights"]


def denoising_error(target: Tensor, velocity: Tensor) -> Tensor:
    """``[B]``: per sample the mean over latent elements of ``(target − velocity)²``."""
    return (target - velocity).square().flatten(1).mean(dim=1)


def group_weights(advantages: Tensor, d: Tensor, d_cmp: Tensor, groups: Tensor, beta_dpo: float) -> Tensor:
    """``[B]``: ``sigmoid(S_g)`` of each sample's group, detached.

    Args:
        advantages: ``[B]`` (clamped) advantages ``A_i``.
        d: ``[B]`` the policy's denoising errors (read detached).
        d_cmp: ``[B]`` the comparison model's errors.
        groups: ``[B]`` long group id of each sample; every member of a group must be in the batch (``|g|`` is the
            number of its members here, the group size).
        beta_dpo: ``β_dpo``.
    """
    _, local = torch.unique(groups, return_inverse=True)
    local = local.to(d.device)
    n = int(local.max()) + 1 if local.numel() else 0
    size = torch.bincount(local, minlength=n).to(d.dtype)
    per_sample = advantages.to(d.dtype) * beta_dpo * (d.detach() - d_cmp.detach()) / size[local]
    scores = torch.zeros(n, dtype=d.dtype, device=d.device).index_add_(0, local, per_sample)
    return torch.sigmoid(scores)[local].detach()


@dataclass(frozen=True)
class DGPOTerms:
    """One timestep's DGPO terms of a batch of whole groups.

    Attributes:
        loss: ``[B]`` ``sg(w_g)·A_i·d_i`` with ``d_i`` detached where clipped (carries the gradient).
        weights: ``[B]`` ``w_g`` of each sample's group.
        clipped: ``[B]`` bool, samples the PPO-style clip stopped (all false without the clip).
    """

    loss: Tensor
    weights: Tensor
    clipped: Tensor


def dgpo_terms(
    d: Tensor,
    d_cmp: Tensor,
    advantages: Tensor,
    groups: Tensor,
    beta_dpo: float,
    d_old: Tensor | None = None,
    clip_range: float = 0.0,
) -> DGPOTerms:
    """DGPO's per-sample loss (module docstring) for a batch holding whole groups.

    Args:
        d: ``[B]`` the policy's denoising errors (with gradient).
        d_cmp: ``[B]`` the comparison errors in ``S_g`` (frozen reference, or the EMA copy with ``use_ema_ref``).
        advantages: ``[B]`` advantages, already clamped.
        groups: ``[B]`` group id of each sample.
        beta_dpo: ``β_dpo``.
        d_old: ``[B]`` the EMA copy's errors for the PPO-style clip; ``None``: no clip.
        clip_range: The clip's ``c``.
    """
    adv = advantages.to(d.dtype)
    weights = group_weights(adv, d, d_cmp, groups, beta_dpo)
    clipped = torch.zeros_like(d, dtype=torch.bool)
    if d_old is not None:
        ratio = torch.exp(-d.detach() + d_old.detach())
        clipped = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    trained = torch.where(clipped, d.detach(), d)
    return DGPOTerms(loss=weights * adv * trained, weights=weights, clipped=clipped)
