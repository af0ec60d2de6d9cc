"""DiffusionNFT's loss terms, as this plugin names them: the optimality weight, the implicit positive and negative
policies, the adaptively weighted x0-space loss and their combination (arXiv 2509.16117, Sec. 3).

The formulas live once, in rlpost's core (``rlpost/ops/likelihood_free.py``, reached through the ``rlpost`` facade),
because TreeNFT trains the same terms at a rollout tree's nodes; this module only keeps the names the update rule and
its tests use.
"""

from __future__ import annotations

from rlpost import ADAPTIVE_WEIGHT_FLOOR, NFTTerms, adaptive_x0_loss, implicit_policies, nft_loss, optimality_weight

__all__ = ["WEIGHT_FLOOR", "NFTTerms", "adaptive_x0_loss", "implicit_policies", "nft_loss", "optimality_weight"]

WEIGHT_FLOOR = ADAPTIVE_WEIGHT_FLOOR
"""Smallest adaptive weight ``w±`` (upstream's ``clip(min=0.00001)``)."""
