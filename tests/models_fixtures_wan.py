"""Fixtures for the Wan2.1 adapter tests: the tiny real-architecture ``WanPipeline``, saved once per session.

Imported by the test modules that use them (``from tests.models_fixtures_wan import ...``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = ["WAN_FRAMES", "WAN_HEIGHT", "WAN_WIDTH", "make_wan_policy", "tiny_wan_dir"]

WAN_HEIGHT, WAN_WIDTH, WAN_FRAMES = 32, 48, 9
"""The tests' video: 9 frames (3 latent frames) of 32 x 48 pixels (4 x 6 latents, 2 x 3 patches); non-square so a
height/width swap shows."""


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``WanPipeline`` (VAE factors 8 / 4, patch 1x2x2, flow-match Euler) saved once."""
    from rlpost.models.tiny_wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan") / "pipe", seed=0)


@pytest.fixture
def make_wan_policy(tiny_wan_dir: Path) -> Callable[..., Any]:
    """Factory: ``make_wan_policy(**kwargs)`` -> a ``WanPolicy`` on the tiny pipeline, set up on CPU in fp32."""
    from rlpost.models.wan import WanPolicy

    def make(**kwargs: Any) -> WanPolicy:
        kwargs.setdefault("height", WAN_HEIGHT)
        kwargs.setdefault("width", WAN_WIDTH)
        kwargs.setdefault("num_frames", WAN_FRAMES)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_sequence_length", 32)
        policy = WanPolicy(str(kwargs.pop("pretrained", tiny_wan_dir)), **kwargs)
        policy.setup(torch.device("cpu"))
        return policy

    return make
