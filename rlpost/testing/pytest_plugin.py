"""rlpost's pytest plugin: session fixtures for the conformance kit (:mod:`rlpost.testing`).

Installed rlpost declares it as a ``pytest11`` entry point, so pytest loads it in every session of that environment
(cheap: nothing heavy is imported until a fixture is used). Without the entry point, load it with
``pytest -p rlpost.testing.pytest_plugin`` or ``pytest_plugins = ["rlpost.testing.pytest_plugin"]`` in a top-level
``conftest.py``.

Fixtures:

* ``rlpost_tiny_sd3_dir`` / ``rlpost_tiny_flux_dir``: a tiny random-weight SD3 / FLUX.1 diffusers pipeline (32 px),
  saved once per session with ``save_pretrained`` (:mod:`rlpost.models.tiny`);
* ``rlpost_tiny_policy`` / ``rlpost_tiny_flux_policy``: ``SD3Policy`` / ``FluxPolicy`` on it with a rank-4 LoRA, set
  up on CPU in fp32 through ``from_pretrained`` (:func:`rlpost.testing.tiny_policy`). Shared by the session: the
  checks restore its weights, and a test that trains it must do the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

__all__ = ["rlpost_tiny_flux_dir", "rlpost_tiny_flux_policy", "rlpost_tiny_policy", "rlpost_tiny_sd3_dir"]


@pytest.fixture(scope="session")
def rlpost_tiny_sd3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``StableDiffusion3Pipeline`` (32 px, VAE factor 2, patch 2) saved once per session."""
    from rlpost.models.tiny import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("rlpost_tiny_sd3") / "pipe", seed=0, sample_size=32)


@pytest.fixture(scope="session")
def rlpost_tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``FluxPipeline`` (32 px, VAE factor 2, 2x2 packing, guidance embedding) saved once."""
    from rlpost.models.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("rlpost_tiny_flux") / "pipe", seed=0, sample_size=32)


@pytest.fixture(scope="session")
def rlpost_tiny_policy(rlpost_tiny_sd3_dir: Path) -> Any:
    """``SD3Policy`` on the tiny pipeline with a rank-4 LoRA, set up on CPU in fp32 (one per session)."""
    from rlpost.testing.inputs import tiny_policy

    return tiny_policy("sd3", rlpost_tiny_sd3_dir)


@pytest.fixture(scope="session")
def rlpost_tiny_flux_policy(rlpost_tiny_flux_dir: Path) -> Any:
    """``FluxPolicy`` on the tiny pipeline with a rank-4 LoRA, set up on CPU in fp32 (one per session)."""
    from rlpost.testing.inputs import tiny_policy

    return tiny_policy("flux", rlpost_tiny_flux_dir)
