"""The advantage-estimator contract: reward scores to one advantage per edge.

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from torch import Tensor

from rlpost.core.api.component import Component
from rlpost.core.contract import RewardScores, Rollout

__all__ = ["AdvantageEstimator", "Advantages"]


@dataclass(frozen=True)
class Advantages:
    """Output of an advantage estimator.

    Attributes:
        edges: ``[E]`` advantage per edge of the rollout (zero on non-trainable edges).
        samples: ``[S]`` advantage of each decoded sample (leaf), for logging.
        metrics: Scalars to log under ``adv/``.
    """

    edges: Tensor
    samples: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class AdvantageEstimator(Component):
    """Turns per-source reward scores into one advantage per edge. Pure and rank agnostic: it sees the
    gathered rollout metadata of whole groups."""

    kind: ClassVar[str] = "advantage"
    requires: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Compute advantages for every edge of ``rollout``."""
