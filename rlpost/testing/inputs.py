"""What the conformance checks feed a component: a tiny real-architecture policy, prompts, images, a rollout and
reward scores, all deterministic.

The policy is built through the production path (``SD3Policy`` / ``FluxPolicy`` loading a saved diffusers pipeline
with ``from_pretrained``, LoRA attached by the adapter), on the tiny random-weight pipelines of
:mod:`rlpost.models.tiny`: the same code a real run executes, at a size that runs on a laptop CPU in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from rlpost.core.api import Policy, Sampler
from rlpost.core.contract import PromptBatch, RewardScores, Rollout

__all__ = [
    "PROMPTS",
    "SCORE_SOURCE",
    "prompt_batch",
    "sample_images",
    "sample_media",
    "sample_rollout",
    "sample_scores",
    "tiny_policy",
]

PROMPTS = (
    "a photo of a cat",
    "a red car on a street",
    "an astronaut riding a horse",
    "a bowl of fruit",
    "a watercolor painting of mountains",
    "a dog wearing sunglasses",
    "a city at night",
    "a plate of sushi",
)
"""Default prompts, cycled when more are needed."""

SCORE_SOURCE = "conformance"
"""Name of the reward source in :func:`sample_scores`."""


def tiny_policy(
    family: Literal["sd3", "flux"] = "sd3",
    pretrained: str | Path = "tiny-random",
    *,
    lora_rank: int = 4,
    resolution: int = 32,
    **overrides: Any,
) -> Policy:
    """A tiny policy with a LoRA adapter, set up on CPU in fp32 (what the fixtures of
    :mod:`rlpost.testing.pytest_plugin` hand out).

    Args:
        family: ``sd3`` (``SD3Policy``) or ``flux`` (``FluxPolicy``).
        pretrained: A saved pipeline directory, or ``tiny-random[:SEED]`` (built once into ``$RLPOST_CACHE`` or
            ``~/.cache/rlpost`` by :mod:`rlpost.models.tiny`).
        lora_rank: LoRA rank (alpha is twice the rank).
        resolution: Image size in pixels.
        **overrides: Further adapter arguments (``guidance_scale``, ``time_grid``, ...).
    """
    from rlpost.models.adapter_settings import LoraSpec

    cls: Any
    if family == "sd3":
        from rlpost.models.sd3 import SD3Policy

        cls = SD3Policy
    elif family == "flux":
        from rlpost.models.flux import FluxPolicy

        cls = FluxPolicy
    else:
        raise ValueError(f"tiny_policy: family must be 'sd3' or 'flux', got {family!r}")
    settings: dict[str, Any] = {
        "dtype": "float32",
        "resolution": resolution,
        "max_sequence_length": 32,
        "lora": LoraSpec(rank=lora_rank, alpha=2 * lora_rank),
        "guidance_scale": 1.0 if family == "sd3" else 3.5,  # SD3 without CFG; FLUX's guidance is an input
    }
    policy: Policy = cls(str(pretrained), **{**settings, **overrides})
    policy.setup(torch.device("cpu"))
    return policy


def prompt_batch(groups: int, samples_per_group: int, group_offset: int = 0) -> PromptBatch:
    """``groups`` prompt groups of :data:`PROMPTS` (cycled), ``samples_per_group`` samples each."""
    prompts = [PROMPTS[(group_offset + g) % len(PROMPTS)] for g in range(groups)]
    return PromptBatch(prompts, [{} for _ in prompts], samples_per_group, group_offset=group_offset)


def sample_images(n: int = 4, size: int = 32, seed: int = 0) -> Tensor:
    """``[n, size, size, 3]`` uint8 images with structure (a diagonal ramp, noise, a per-image shift), deterministic,
    so a scorer that ignores its input or mixes up rows shows."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 255, size)
    base = (ramp[None, :, None] + ramp[:, None, None]) / 2
    noise = torch.randint(0, 80, (n, size, size, 3), generator=g).float()
    shift = torch.arange(n).float().view(n, 1, 1, 1) * 17
    return ((base[None] + noise + shift) % 256).to(torch.uint8)


def sample_media(n: int = 4, frames: int = 3, size: int = 32, seed: int = 0) -> Tensor:
    """``[n, frames, size, size, 3]`` uint8 clips: :func:`sample_images` frames, each clip's frames differing (a
    moving shift), so a video scorer that ignores frames or mixes up clips shows."""
    clips = [sample_images(n, size, seed + f) for f in range(frames)]
    return torch.stack(clips, dim=1)


def sample_rollout(
    sampler: Sampler, policy: Policy, groups: int = 2, samples_per_group: int = 2, seed: int = 0, step: int = 0
) -> Rollout:
    """Step ``step``'s rollout as one process runs it: ``begin_step`` with the step's generator, then one ``rollout``
    of the whole batch under ``torch.no_grad``."""
    sampler.begin_step(step, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return sampler.rollout(policy, prompt_batch(groups, samples_per_group), torch.Generator().manual_seed(seed + 1))


def sample_scores(rollout: Rollout, seed: int = 0) -> RewardScores:
    """One reward source (:data:`SCORE_SOURCE`) with distinct, deterministic scores for every sample, so every group
    has a spread and an estimator has something to normalise."""
    g = torch.Generator().manual_seed(seed)
    n = rollout.num_samples
    values = torch.randperm(n, generator=g).float() / max(n - 1, 1) + 0.1 * torch.rand(n, generator=g)
    return RewardScores(scores={SCORE_SOURCE: values}, weights={SCORE_SOURCE: 1.0})
