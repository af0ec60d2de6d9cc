"""The advantage-estimator contract: reward scores to one advantage per decoded sample and one per edge.

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

    Both tensors are first-class: policy-gradient rules read :attr:`edges`, likelihood-free rules (which train on
    the clean samples, :mod:`rlpost.core.api.capabilities`) read :attr:`samples`. The runner guards both alike: a
    non-finite entry of either becomes 0 and is counted by the ``advantage`` guard.

    Attributes:
        edges: ``[E]`` advantage per edge of the rollout (zero on non-trainable edges; empty for a rollout without
            edges).
        samples: ``[S]`` advantage of each decoded sample (a chain's end, a tree's leaf), aligned with
            ``Rollout.sample_node``.
        metrics: Scalars to log under ``adv/``.
    """

    edges: Tensor
    samples: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class AdvantageEstimator(Component):
    """Turns per-source reward scores into one advantage per decoded sample and per edge. Pure and rank agnostic: it
    sees the gathered rollout metadata of whole groups."""

    kind: ClassVar[str] = "advantage"
    requires: ClassVar[frozenset[str]] = frozenset()
    """Capabilities the sampler must provide (:mod:`rlpost.core.api.capabilities`); default: none."""

    @abstractmethod
    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Compute the advantage of every sample and every edge of ``rollout``."""
