"""The reward-source contract: scores for decoded samples.

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rlpost.core.api.component import Component

__all__ = ["MediaScope", "RewardSource"]

MediaScope = Literal["image", "frames", "video"]
"""What a reward's :meth:`RewardSource.score` takes (:attr:`RewardSource.media_scope`)."""


class RewardSource(Component):
    """Scores decoded samples. Heavy models are loaded in :meth:`setup` (once), never at import or registration.

    A reward declares what it scores in :attr:`media_scope`. Image rewards (``"frames"``, the default, or
    ``"image"``) get ``[N, H, W, 3]`` images; the engine hands a video model's samples to them frame by frame and
    reduces each sample's per-frame scores (``reward_frames.reduction``: mean, min, or the first frame's), so an image
    model (one frame per sample) and a video model go through the same code (:mod:`rlpost.ops.media`). A ``"video"``
    reward gets whole ``[S, F, H, W, 3]`` clips and returns one score per clip.
    """

    kind: ClassVar[str] = "reward"
    media_scope: ClassVar[MediaScope] = "frames"
    """``"frames"``: scores images, and a video's frames one by one mean something (the default); ``"image"``: scores
    images only: a recipe whose model generates video (``Policy.frames > 1``) refuses it; ``"video"``: scores whole
    clips, ``score`` gets ``[S, F, H, W, 3]``."""

    def setup(self, device: torch.device) -> None:  # noqa: B027 - weight-free rewards need no set-up
        """Load models onto ``device``. Called once before the first :meth:`score`."""

    @abstractmethod
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return a ``[N]`` float tensor of finite scores: one per ``[N, H, W, 3]`` uint8 image (``media_scope`` is
        ``"frames"`` or ``"image"``; ``prompts`` and ``metadata`` align with the images, a video sample's repeated
        for each of its frames), or one per ``[N, F, H, W, 3]`` clip (``media_scope = "video"``)."""
