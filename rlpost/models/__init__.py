"""Policy model adapters (SD3 and FLUX.1 on diffusers) and tiny real-architecture test models."""

from __future__ import annotations

from rlpost.models.adapter_settings import LoraSpec
from rlpost.models.flux import FluxPolicy
from rlpost.models.pipeline_dir import ModelDirError
from rlpost.models.sd3 import SD3Policy

__all__ = ["FluxPolicy", "LoraSpec", "ModelDirError", "SD3Policy"]
