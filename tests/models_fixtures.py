"""Shared fixtures for model tests: tiny real-architecture SD3 and FLUX pipelines, each saved once per session.

Imported into ``tests/conftest.py`` so every test package can request them. The pipelines are the conformance kit's
(``rlpost.testing.pytest_plugin``, loaded by ``tests/conftest.py``), so a session builds each once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_sd3_dir(rlpost_tiny_sd3_dir: Path) -> Path:
    """A tiny random-weight ``StableDiffusion3Pipeline`` (32 px, VAE factor 2, patch 2) saved with save_pretrained."""
    return rlpost_tiny_sd3_dir


@pytest.fixture
def make_sd3_policy(tiny_sd3_dir: Path) -> Callable[..., Any]:
    """Factory: ``make_sd3_policy(**kwargs)`` -> an ``SD3Policy`` on the tiny pipeline, set up on CPU in fp32."""
    from rlpost.models import SD3Policy

    def make(**kwargs: Any) -> SD3Policy:
        kwargs.setdefault("resolution", 32)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_sequence_length", 32)
        policy = SD3Policy(str(tiny_sd3_dir), **kwargs)
        policy.setup(torch.device("cpu"))
        return policy

    return make


@pytest.fixture(scope="session")
def tiny_flux_dir(rlpost_tiny_flux_dir: Path) -> Path:
    """A tiny random-weight ``FluxPipeline`` (32 px, VAE factor 2, 2x2 packing, guidance embedding) saved once."""
    return rlpost_tiny_flux_dir


@pytest.fixture
def make_flux_policy(tiny_flux_dir: Path) -> Callable[..., Any]:
    """Factory: ``make_flux_policy(**kwargs)`` -> a ``FluxPolicy`` on the tiny pipeline, set up on CPU in fp32."""
    from rlpost.models import FluxPolicy

    def make(**kwargs: Any) -> FluxPolicy:
        kwargs.setdefault("resolution", 32)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("max_sequence_length", 32)
        policy = FluxPolicy(str(tiny_flux_dir), **kwargs)
        policy.setup(torch.device("cpu"))
        return policy

    return make
