"""A complete rlpost reward plugin: the mean brightness of each image, in [0, 1]."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from rlpost import RewardSource, hookimpl


class Brightness(RewardSource):
    """Mean pixel value / 255. Use in a recipe as ``rewards: [{class_path: brightness}]``."""

    name: ClassVar[str] = "brightness"

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """``[S, H, W, 3]`` uint8 -> ``[S]`` float in [0, 1]."""
        return images.float().mean(dim=(1, 2, 3)).cpu() / 255.0


@hookimpl
def rlpost_register_reward_sources(register: Any) -> None:
    """Register the reward with rlpost."""
    register(Brightness)
