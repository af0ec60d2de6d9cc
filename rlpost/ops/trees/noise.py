"""Where a tree rollout's Gaussian draws come from: one generator for the batch, or one per prompt group.

``TreeSampler.rollout`` draws everything from the step's generator (:class:`SharedNoise`); ``rollout_groups`` gives
group ``j`` its own generator (:class:`PerGroupNoise`), drawing exactly what a one-group rollout with that generator
draws, so both produce the same leaves (``plugins/rlpost_treegrpo/sampler.py``, "RNG order").
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlpost.core.api import Policy

__all__ = ["NoiseSource", "PerGroupNoise", "SharedNoise"]


class NoiseSource:
    """Where a rollout's Gaussian draws come from: one generator for the batch, or one per prompt group."""

    def initial(self, policy: Policy, per_group: int) -> Tensor:
        """``[G·per_group, ...]`` initial noises, group-major."""
        raise NotImplementedError

    def normal(self, per_group: int, shape: torch.Size) -> Tensor:
        """``[G·per_group, *shape]`` fp32 standard normals, group-major (each group's rows a contiguous block)."""
        raise NotImplementedError


class SharedNoise(NoiseSource):
    """Every draw from one generator, in one block (the sampler's RNG order before per-group generators existed)."""

    def __init__(self, generator: torch.Generator, num_groups: int) -> None:
        self.generator = generator
        self.num_groups = num_groups

    def initial(self, policy: Policy, per_group: int) -> Tensor:
        return policy.initial_noise(per_group * self.num_groups, self.generator)

    def normal(self, per_group: int, shape: torch.Size) -> Tensor:
        g = self.generator
        return torch.randn((per_group * self.num_groups, *shape), generator=g, device=g.device, dtype=torch.float32)


class PerGroupNoise(NoiseSource):
    """Group ``j`` draws from ``generators[j]`` exactly what a one-group rollout with that generator draws."""

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.generators = generators

    def initial(self, policy: Policy, per_group: int) -> Tensor:
        return torch.cat([policy.initial_noise(per_group, g).to(torch.float32) for g in self.generators])

    def normal(self, per_group: int, shape: torch.Size) -> Tensor:
        return torch.cat(
            [
                torch.randn((per_group, *shape), generator=g, device=g.device, dtype=torch.float32)
                for g in self.generators
            ]
        )
