"""HPS-v2.1 (Human Preference Score v2.1, Wu et al. 2023, arXiv:2306.09341) built directly on open_clip with a
local checkpoint.

The ``hpsv2`` package's ``score`` builds the model from hub-downloaded CLIP weights, fetches the checkpoint from the
hub unless given ``cp``, and re-reads it on every call (``tgxs002/HPSv2 hpsv2/img_score.py@866735e``). We do what
MixGRPO does (``Tencent-Hunyuan/MixGRPO fastvideo/models/reward_model/hps_score.py@e5cdd6a``): create open_clip
``ViT-H-14`` without pretrained weights and load the fine-tuned ``{"state_dict": ...}`` checkpoint once.

Preprocessing follows HPSv2's eval transform (``create_model_and_transforms(..., light_augmentation=True)``):
``ToTensor`` -> ``ResizeMaxSize`` (longest side to 224, bicubic, on floats, zero padding to a square) ->
``Normalize`` with OpenAI CLIP's statistics; a non-square image is letterboxed, not centre-cropped.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost import HubFiles, RewardSource

from ._common import DTypeName, check_images, check_scores, load_state_dict_file, to_dtype
from ._openclip import OpenClipScorer
from ._paths import HubSource, PathSpec, hub_files_of, path_problems, resolve_specs

__all__ = ["HPSv2Reward", "load_hps_state_dict"]

DEFAULT_FILE = "HPS_v2.1_compressed.pt"
OBTAIN = "https://huggingface.co/xswu/HPSv2 (file HPS_v2.1_compressed.pt; v2.0 is HPS_v2_compressed.pt)"
HUB = HubSource(HubFiles("xswu/HPSv2", (DEFAULT_FILE,), purpose="HPS-v2.1 checkpoint"), DEFAULT_FILE)


def load_hps_state_dict(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read an HPS checkpoint (``{"state_dict": ...}``) with ``torch.load(weights_only=True)``."""
    return load_state_dict_file(path)


class HPSv2Reward(RewardSource):
    """HPS-v2.1: cosine of the normalised open_clip image and prompt features (typical 0.25-0.38).

    Scores are only comparable across images of the same prompt (HPSv2 README); per-group normalisation in the
    advantage takes care of that.

    Args:
        checkpoint: Path to ``HPS_v2.1_compressed.pt``; default ``$RLPOST_MODELS/HPS_v2.1_compressed.pt``.
        model_name: open_clip config of the backbone (``ViT-H-14`` for HPS v2/v2.1).
        dtype: Compute dtype of the CLIP towers (scores are returned in fp32).
    """

    name: ClassVar[str] = "hps-v2.1"

    def __init__(
        self, checkpoint: str | None = None, model_name: str = "ViT-H-14", dtype: DTypeName = "float32"
    ) -> None:
        self.checkpoint = checkpoint
        self.model_name = model_name
        self.dtype = to_dtype(dtype)
        self._scorer: OpenClipScorer | None = None

    def validate(self, recipe: Any) -> list[str]:
        """The checkpoint must be installed (a file check; nothing loads)."""
        return path_problems(self, recipe, self._specs())

    def _specs(self) -> list[PathSpec]:
        return [PathSpec("checkpoint", self.checkpoint, DEFAULT_FILE, "HPS-v2.1 checkpoint", OBTAIN, hub=HUB)]

    def hub_files(self) -> list[HubFiles]:
        """The HPS-v2.1 checkpoint, unless given by path."""
        return hub_files_of(self._specs())

    def setup(self, device: torch.device) -> None:
        """Load the checkpoint into open_clip ``model_name`` on ``device`` (once; later calls are no-ops)."""
        if self._scorer is not None:
            return
        path = resolve_specs(self.name, self._specs())["checkpoint"]
        state = load_hps_state_dict(path)
        device = torch.device(device)
        self._scorer = OpenClipScorer.build(
            self.name, self.model_name, device, self.dtype, state, resize_mode="longest", float_resize=True
        )

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return the HPS diagonal ``cos(f_img_i, f_txt_i)`` per image, fp32 on CPU."""
        check_images(self.name, images, prompts)
        if self._scorer is None:
            raise RuntimeError(f"{self.name}: call setup(device) before score()")
        return check_scores(self.name, self._scorer.cosine(images, prompts))
