"""Named weight copies: sets of the policy's trainable weights besides the live ones, which a rollout can run under
and a loss can evaluate.

Part of :mod:`rlpost.core.api` (the package re-exports every name).

Likelihood-free rules keep lagging copies of the policy: DiffusionNFT samples with a soft-updated "old" policy and
contrasts it with the live one (arXiv 2509.16117, Sec. 3; NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``
@24af555), AWM regularises towards an EMA copy (scxue/advantage_weighted_matching
``advantage_weighted_matching/scripts/train_sd3_awm.py`` @be51372), DGPO samples and clips against an EMA reference
(Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py`` @01ceb4b). A recipe declares such copies in its ``copies`` section
(name -> decay schedule, :class:`rlpost.engine.weight_copies.CopyConfig`); the frozen reference model is always there
under :data:`REFERENCE` (:meth:`~rlpost.core.api.Policy.reference`). Update rules name the copies they need
(:meth:`~rlpost.core.api.PolicyOptimizer.required_copies`) and ``rlpost validate`` checks the recipe declares them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Final

__all__ = ["LIVE", "REFERENCE", "WeightCopies"]

REFERENCE: Final = "reference"
"""The frozen reference policy (the base model with LoRA off, or a frozen copy under full fine-tuning)."""

LIVE: Final = "live"
"""The weights being trained; not a copy (``use(LIVE)`` changes nothing). Reserved: no copy may take the name."""


class WeightCopies(ABC):
    """The weight copies one run keeps, as an update rule and the runner see them (the engine implements it)."""

    @abstractmethod
    def names(self) -> tuple[str, ...]:
        """The copies that can be used: :data:`REFERENCE` and every copy the recipe declares."""

    @abstractmethod
    def use(self, name: str) -> AbstractContextManager[None]:
        """Context in which the policy computes with copy ``name`` instead of the live weights, restored exactly on
        exit. Use it under ``torch.no_grad()``: a copy is never trained. A collective call under DeepSpeed ZeRO
        (every rank must enter it with the same name).

        Raises:
            KeyError: No copy of that name (the message lists the ones there are).
        """
