"""Fixtures for the reward-source tests: tiny models of the real architectures with random weights, saved in the
real checkpoint formats, and deterministic uint8 images."""

from __future__ import annotations

import pytest
import torch

from rlpost.testing import PROMPTS as KIT_PROMPTS
from rlpost.testing import sample_images

from .checkpoints import register_tiny_open_clip, tiny_open_clip_state


@pytest.fixture(scope="session")
def tiny_clip_name(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Register a tiny open_clip config (same CLIP architecture as ViT-H-14, tiny sizes) and return its name."""
    return register_tiny_open_clip(tmp_path_factory.mktemp("open_clip_cfg"))


@pytest.fixture(scope="session")
def tiny_clip_state(tiny_clip_name: str) -> dict[str, torch.Tensor]:
    """Random weights of the tiny open_clip model (seeded)."""
    return tiny_open_clip_state(tiny_clip_name)


def make_images(n: int = 8, size: int = 40, seed: int = 0) -> torch.Tensor:
    """``[n, size, size, 3]`` uint8 images with some structure (gradients + noise), deterministic: the conformance
    kit's (:func:`rlpost.testing.sample_images`)."""
    return sample_images(n, size, seed)


PROMPTS = list(KIT_PROMPTS)


class LoadCounter:
    """Wraps a function and counts calls (to check a reward loads its model once)."""

    def __init__(self, fn):  # noqa: ANN001
        self.fn = fn
        self.calls = 0

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.calls += 1
        return self.fn(*args, **kwargs)


def check_reward_contract(reward, images: torch.Tensor, prompts: list[str], tol: float = 1e-5) -> torch.Tensor:  # noqa: ANN001
    """The conformance kit's reward checks (``rlpost.testing.check_reward_source``: finite ``[S]`` scores,
    deterministic, a batch of S agrees with S single-image calls, inputs untouched) on a set-up reward, plus: fp32,
    and a random tiny model still tells the images apart."""
    from rlpost.testing import check_reward_source

    scores = check_reward_source(reward, images, prompts, setup=False, tol=tol)
    assert scores is not None and scores.dtype == torch.float32
    assert scores.std() > 0, "random tiny model should still discriminate between images"
    return scores
