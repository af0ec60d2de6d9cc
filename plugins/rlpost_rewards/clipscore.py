"""CLIPScore via open_clip with local weights.

Conventions differ: MixGRPO reports the **raw cosine** (``Tencent-Hunyuan/MixGRPO
fastvideo/models/reward_model/clip_score.py@e5cdd6a``; ≈0.36-0.40; our default), torchmetrics' ``CLIPScore`` uses
``max(100·cos, 0)`` (``scale_100=True``), Hessel et al. (arXiv:2104.08718, section 3) ``2.5·max(cos, 0)``. The
default backbone follows MixGRPO: ``apple/DFN5B-CLIP-ViT-H-14-384`` (open_clip config ``ViT-H-14-378-quickgelu``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost import HubFiles, RewardSource

from ._common import DTypeName, check_images, check_scores, to_dtype
from ._openclip import OpenClipScorer
from ._paths import HubSource, PathSpec, hub_files_of, path_problems, resolve_specs

__all__ = ["CLIPScoreReward"]

DEFAULT_FILE = "DFN5B-CLIP-ViT-H-14-384/open_clip_pytorch_model.bin"
OBTAIN = (
    "https://huggingface.co/apple/DFN5B-CLIP-ViT-H-14-384 (file open_clip_pytorch_model.bin), or any open_clip "
    "weights file matching `model_name`"
)
HUB = HubSource(
    HubFiles("apple/DFN5B-CLIP-ViT-H-14-384", ("open_clip_pytorch_model.bin",), purpose="CLIPScore open_clip weights"),
    "open_clip_pytorch_model.bin",
)


class CLIPScoreReward(RewardSource):
    """Cosine similarity of normalised open_clip image and prompt embeddings.

    Args:
        pretrained: Local open_clip weights file (``.bin``/``.pt`` loaded with ``weights_only=True``, or
            ``.safetensors``); default ``$RLPOST_MODELS/DFN5B-CLIP-ViT-H-14-384/open_clip_pytorch_model.bin``.
        model_name: open_clip model config matching the weights.
        scale_100: Return ``100·max(cos, 0)`` (torchmetrics convention) instead of the raw cosine.
        dtype: Compute dtype of the CLIP towers (scores are returned in fp32).
    """

    name: ClassVar[str] = "clipscore"

    def __init__(
        self,
        pretrained: str | None = None,
        model_name: str = "ViT-H-14-378-quickgelu",
        scale_100: bool = False,
        dtype: DTypeName = "float32",
    ) -> None:
        self.pretrained = pretrained
        self.model_name = model_name
        self.scale_100 = scale_100
        self.dtype = to_dtype(dtype)
        self._scorer: OpenClipScorer | None = None

    def validate(self, recipe: Any) -> list[str]:
        """The weights must be installed (a file check; nothing loads)."""
        return path_problems(self, recipe, self._specs())

    def _specs(self) -> list[PathSpec]:
        return [PathSpec("pretrained", self.pretrained, DEFAULT_FILE, "open_clip weights", OBTAIN, hub=HUB)]

    def hub_files(self) -> list[HubFiles]:
        """The open_clip weights, unless given by path."""
        return hub_files_of(self._specs())

    def setup(self, device: torch.device) -> None:
        """Create the open_clip model from the local weights on ``device`` (once)."""
        if self._scorer is not None:
            return
        path = resolve_specs(self.name, self._specs())["pretrained"]
        self._scorer = OpenClipScorer.build(
            self.name, self.model_name, torch.device(device), self.dtype, pretrained=str(path)
        )

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return ``cos`` (or ``100·max(cos, 0)``) per (image, prompt), fp32 on CPU."""
        check_images(self.name, images, prompts)
        if self._scorer is None:
            raise RuntimeError(f"{self.name}: call setup(device) before score()")
        cos = self._scorer.cosine(images, prompts)
        if self.scale_100:
            cos = 100.0 * cos.clamp_min(0.0)
        return check_scores(self.name, cos)
