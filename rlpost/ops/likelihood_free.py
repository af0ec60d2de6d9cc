"""DiffusionNFT's loss terms (Zheng et al., arXiv 2509.16117, Sec. 3): the optimality weight, the implicit positive
and negative policies and the adaptively weighted x0-space flow-matching loss, shared by every rule that trains them
(DiffusionNFT on re-noised clean samples, ``plugins/rlpost_nft``; TreeNFT at a rollout tree's own nodes,
``plugins/rlpost_treenft``).

Per row (a noisy state ``x_t`` at noise level ``t`` and the clean latent ``x0`` it is regressed towards, e.g. a clean
sample re-noised to ``x_t = (1-t)·x0 + t·ε``), with the live velocity ``v_θ``, the old copy's ``v_old`` (no gradient)
and, for the KL term, the frozen reference's ``v_ref`` (no gradient)::

    r    = clip(clip(A, -M, M) / M / 2 + 1/2, 0, 1)              optimality probability of the sample
    v⁺   = β·v_θ + (1-β)·v_old                                   implicit positive policy
    v⁻   = (1+β)·v_old - β·v_θ                                   implicit negative policy
    x̂0±  = x_t - t·v±
    w±   = max(mean_elem |x̂0± - x0|, 1e-5)                       adaptive weight, no gradient, fp64
    L±   = mean_elem (x̂0± - x0)² / w±
    ℓ    = M·(r·L⁺ + (1-r)·L⁻) / β  +  β_KL·mean_elem (v_θ - v_ref)²

``M`` is ``adv_clip_max`` (5), ``β`` NFT's guidance strength (upstream ``config.beta``), ``β_KL`` the KL weight
(upstream ``config.train.beta``). This is NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` @24af555 L909-970 restated:
the paper writes ``r = 1/2 + 1/2·clip(A/Z, -1, 1)``, which the code realises with ``Z = M`` on already normalised
advantages, and multiplies the policy term by ``M``. Since ``x̂0± - x0 = t·((x_t - x0)/t - v±)``, the loss is the
paper's velocity-space loss ``r·‖v⁺ - v‖² + (1-r)·‖v⁻ - v‖²`` with the flow-matching target ``v = (x_t - x0)/t``
(``= ε - x0`` for a re-noised sample) scaled per row by ``t²/w±``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ADAPTIVE_WEIGHT_FLOOR",
    "NFTTerms",
    "adaptive_x0_loss",
    "implicit_policies",
    "nft_loss",
    "optimality_weight",
]

ADAPTIVE_WEIGHT_FLOOR = 1e-5
"""Smallest adaptive weight ``w±`` (upstream's ``clip(min=0.00001)``)."""


def optimality_weight(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """``r = clip(clip(A, -M, M) / M / 2 + 1/2, 0, 1)`` per sample: 0 for the worst, 1/2 for an average, 1 for the
    best sample (``M = adv_clip_max``)."""
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (clipped / adv_clip_max / 2 + 0.5).clamp(0.0, 1.0)


def implicit_policies(v_theta: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """``(v⁺, v⁻) = (β·v_θ + (1-β)·v_old, (1+β)·v_old - β·v_θ)``; ``v_old`` is detached (the old copy is never
    trained)."""
    old = v_old.detach()
    return beta * v_theta + (1 - beta) * old, (1 + beta) * old - beta * v_theta


def adaptive_x0_loss(x0_pred: Tensor, x0: Tensor) -> Tensor:
    """``[B]`` fp64 ``mean_elem (x̂0 - x0)² / w`` with ``w = max(mean_elem |x̂0 - x0|, 1e-5)`` computed in fp64 without
    gradient: each row's squared error divided by its own mean absolute error, so rows at every noise level weigh
    alike."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (
            (x0_pred.detach().double() - x0.double())
            .abs()
            .mean(dim=dims, keepdim=True)
            .clamp_min(ADAPTIVE_WEIGHT_FLOOR)
        )
    return ((x0_pred - x0) ** 2 / weight).mean(dim=dims)


@dataclass(frozen=True)
class NFTTerms:
    """One batch's loss terms, per row.

    Attributes:
        total: ``[B]`` the row's loss ``ℓ`` (policy term plus the weighted KL term).
        policy: ``[B]`` ``M·(r·L⁺ + (1-r)·L⁻)/β``.
        positive: ``[B]`` ``L⁺``.
        negative: ``[B]`` ``L⁻``.
        kl: ``[B]`` ``mean_elem (v_θ - v_ref)²`` (zeros without a reference velocity).
    """

    total: Tensor
    policy: Tensor
    positive: Tensor
    negative: Tensor
    kl: Tensor


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    x0: Tensor,
    x_t: Tensor,
    t: Tensor,
    r: Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    v_ref: Tensor | None = None,
    kl_beta: float = 0.0,
) -> NFTTerms:
    """DiffusionNFT's per-row loss (the module docstring gives the formulas).

    Args:
        v_theta: ``[B, ...]`` live velocity (with gradient).
        v_old: ``[B, ...]`` old copy's velocity (detached here).
        x0: ``[B, ...]`` clean samples.
        x_t: ``[B, ...]`` the noisy states the velocities were evaluated at.
        t: ``[B]`` noise level of each row.
        r: ``[B]`` optimality weight of each row's sample (:func:`optimality_weight`).
        beta: NFT's ``β > 0`` (upstream ``config.beta``).
        adv_clip_max: ``M``, the advantage clip the policy term is multiplied by.
        v_ref: ``[B, ...]`` frozen reference velocity (detached here), or ``None`` without the KL term.
        kl_beta: ``β_KL`` (upstream ``config.train.beta``).
    """
    shape = (-1,) + (1,) * (x0.ndim - 1)
    t_b = t.to(x_t.dtype).reshape(shape)
    v_pos, v_neg = implicit_policies(v_theta, v_old, beta)
    positive = adaptive_x0_loss(x_t - t_b * v_pos, x0)
    negative = adaptive_x0_loss(x_t - t_b * v_neg, x0)
    r64 = r.to(positive.dtype)
    policy = adv_clip_max * (r64 * positive + (1 - r64) * negative) / beta
    if v_ref is None:
        kl = torch.zeros_like(policy)
    else:
        kl = ((v_theta - v_ref.detach()) ** 2).mean(dim=tuple(range(1, x0.ndim))).to(policy.dtype)
    return NFTTerms(total=policy + kl_beta * kl, policy=policy, positive=positive, negative=negative, kl=kl)
