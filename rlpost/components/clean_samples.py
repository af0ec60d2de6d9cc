"""The training batch of a likelihood-free update rule: each decoded sample's clean latent, its prompt's
conditioning, its advantage and its rank-independent keys.

Likelihood-free rules (DiffusionNFT, AWM, DGPO; :mod:`rlpost.core.api.capabilities`) never look at a rollout's edges:
they re-noise the clean samples ``x0 = Rollout.states[Rollout.sample_node]`` at noise levels they draw themselves
(:mod:`rlpost.ops.training_noise`) and train a flow-matching loss weighted by the per-sample advantages. This module
gathers those inputs once per step so each rule's file holds only its loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlpost.core.api import Conditioning, UpdateContext
from rlpost.ops.training_noise import sample_keys

__all__ = ["CleanBatch", "clean_batch", "sample_chunks"]


@dataclass(frozen=True)
class CleanBatch:
    """A step's samples as a likelihood-free rule trains on them (this rank's, in rollout order).

    Attributes:
        x0: ``[S, *latent_shape]`` fp32 clean latents (no gradient).
        cond: ``S`` rows of conditioning (each sample's prompt).
        advantages: ``[S]`` fp32 per-sample advantages (``Advantages.samples``, guarded finite by the runner).
        groups: ``[S]`` long global prompt-group index of each sample.
        keys: ``(global group, place in group)`` per sample, for draws that do not depend on the rank count.
    """

    x0: Tensor
    cond: Conditioning
    advantages: Tensor
    groups: Tensor
    keys: list[tuple[int, int]]

    @property
    def size(self) -> int:
        """Number of samples ``S``."""
        return int(self.x0.shape[0])


def clean_batch(ctx: UpdateContext) -> CleanBatch:
    """The clean samples of ``ctx.rollout`` with their conditioning and advantages, on the policy's device.

    Raises:
        ValueError: The advantages do not hold one value per sample.
    """
    rollout, policy = ctx.rollout, ctx.policy
    adv = ctx.advantages.samples
    if int(adv.shape[0]) != rollout.num_samples:
        raise ValueError(f"Advantages.samples has {int(adv.shape[0])} rows for {rollout.num_samples} samples")
    x0 = rollout.states[rollout.sample_node].detach().to(policy.device, torch.float32)
    cond = policy.encode(rollout.prompts).select(rollout.sample_group)
    groups = rollout.sample_group.cpu() + rollout.group_offset
    return CleanBatch(x0, cond, adv.detach().to(policy.device, torch.float32), groups, sample_keys(rollout))


def sample_chunks(order: Tensor, size: int) -> list[Tensor]:
    """``order`` (sample indices) cut into consecutive chunks of at most ``size`` (``0``: one chunk), the minibatches
    of a rule's forward/backward passes (a memory budget: gradients accumulate over them)."""
    if size <= 0 or size >= order.numel():
        return [order]
    return list(torch.split(order, size))
