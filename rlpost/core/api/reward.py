"""The reward-source contract: scores for decoded samples.

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost.core.api.component import Component

__all__ = ["RewardSource"]


class RewardSource(Component):
    """Scores decoded images. Heavy models are loaded in :meth:`setup` (once), never at import or registration."""

    kind: ClassVar[str] = "reward"

    def setup(self, device: torch.device) -> None:  # noqa: B027 - weight-free rewards need no set-up
        """Load models onto ``device``. Called once before the first :meth:`score`."""

    @abstractmethod
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return a ``[S]`` float tensor of finite scores for ``[S, H, W, 3]`` uint8 ``images``."""
