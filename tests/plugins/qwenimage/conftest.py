"""Fixtures of the Qwen-Image plugin tests: the tiny real-architecture ``QwenImagePipeline``, built once per session,
and set-up CPU fp32 policies on it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost_qwenimage.policy import QwenImagePolicy
from rlpost_qwenimage.tiny import build_tiny_qwenimage


@pytest.fixture(scope="session")
def tiny_qwenimage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``QwenImagePipeline`` (VAE factor 2, 2x2 packing, 4 latent channels) saved once."""
    return build_tiny_qwenimage(tmp_path_factory.mktemp("tiny_qwenimage") / "pipe", seed=0)


@pytest.fixture
def make_qwen_policy(tiny_qwenimage_dir: Path) -> Callable[..., QwenImagePolicy]:
    """Factory: ``make_qwen_policy(**kwargs)`` -> a ``QwenImagePolicy`` on the tiny pipeline, set up on CPU in fp32
    at 32 px (guidance on with the default ``true_cfg_scale`` 4)."""

    def make(**kwargs: Any) -> QwenImagePolicy:
        kwargs.setdefault("resolution", 32)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_sequence_length", 32)
        policy = QwenImagePolicy(str(tiny_qwenimage_dir), **kwargs)
        policy.setup(torch.device("cpu"))
        return policy

    return make


@pytest.fixture(scope="module")
def qwen_host() -> Any:
    """A plugin host with the first-party plugins, ``rlpost_qwenimage`` among them through its entry point."""
    from rlpost.apps.host import build_host

    return build_host()
