"""LAION aesthetic predictor v2 ("improved-aesthetic-predictor", ``sac+logos+ava1-l14-linearMSE.pth``).

OpenAI CLIP ViT-L/14 image embedding, L2-normalised, through a linear MLP 768→1024→128→64→16→1 with dropout and
no non-linearities (``kvablack/ddpo-pytorch ddpo_pytorch/aesthetic_scorer.py@1958463``). Scale ≈ 1-10.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rlpost import HubFiles, RewardSource

from ._common import DTypeName, check_images, check_scores, load_state_dict_file, to_dtype
from ._hfclip import HFClip
from ._paths import HubSource, PathSpec, hub_files_of, path_problems, resolve_specs

__all__ = ["AestheticMLP", "AestheticReward", "load_aesthetic_head"]

DEFAULT_CLIP_DIR = "clip-vit-large-patch14"
DEFAULT_HEAD = "sac+logos+ava1-l14-linearMSE.pth"
OBTAIN_CLIP = "https://huggingface.co/openai/clip-vit-large-patch14 (the whole repository snapshot, safetensors)"
OBTAIN_HEAD = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor (file sac+logos+ava1-l14-linearMSE.pth; "
    "also bundled in ddpo-pytorch and flow_grpo `assets/`)"
)
HUB_CLIP = HubSource(
    HubFiles("openai/clip-vit-large-patch14", ("*.json", "*.txt", "model.safetensors"), purpose="CLIP ViT-L/14")
)
# The same head on the Hub: TRL's DDPO aesthetic scorer loads this file into the same MLP (layers.0 ... layers.7;
# huggingface/trl trl/models/auxiliary_modules.py, aesthetic_scorer), under another name.
HUB_HEAD = HubSource(
    HubFiles("trl-lib/ddpo-aesthetic-predictor", ("aesthetic-model.pth",), purpose="aesthetic head"),
    "aesthetic-model.pth",
)


class AestheticMLP(nn.Module):
    """The predictor head; parameter names (``layers.0`` … ``layers.7``) match the released ``.pth``.

    Args:
        input_size: Embedding width (768 for ViT-L/14).
    """

    def __init__(self, input_size: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: Tensor) -> Tensor:
        """``[S, D]`` -> ``[S, 1]``."""
        out: Tensor = self.layers(embed)
        return out


def load_aesthetic_head(path: str | os.PathLike[str]) -> AestheticMLP:
    """Build the head sized from the file and load it strictly (``weights_only=True`` or safetensors)."""
    state = load_state_dict_file(path)
    if "layers.0.weight" not in state:
        raise ValueError(f"{path}: not an aesthetic-predictor head (no 'layers.0.weight'); keys {sorted(state)[:6]}")
    head = AestheticMLP(int(state["layers.0.weight"].shape[1]))
    head.load_state_dict(state)
    return head.eval().requires_grad_(False)


class AestheticReward(RewardSource):
    """LAION aesthetic score of each image (prompt ignored).

    Args:
        clip_dir: Local directory of ``openai/clip-vit-large-patch14`` (transformers format); default
            ``$RLPOST_MODELS/clip-vit-large-patch14``.
        head: Predictor weights (``.pth`` loaded with ``weights_only=True``, or ``.safetensors``); default
            ``$RLPOST_MODELS/sac+logos+ava1-l14-linearMSE.pth``.
        dtype: Compute dtype of the CLIP vision tower (the head runs in fp32).
    """

    name: ClassVar[str] = "aesthetic"

    def __init__(self, clip_dir: str | None = None, head: str | None = None, dtype: DTypeName = "float32") -> None:
        self.clip_dir = clip_dir
        self.head = head
        self.dtype = to_dtype(dtype)
        self._clip: HFClip | None = None
        self._head: AestheticMLP | None = None

    def _specs(self) -> list[PathSpec]:
        return [
            PathSpec("clip_dir", self.clip_dir, DEFAULT_CLIP_DIR, "CLIP ViT-L/14", OBTAIN_CLIP, True, HUB_CLIP),
            PathSpec("head", self.head, DEFAULT_HEAD, "aesthetic head", OBTAIN_HEAD, hub=HUB_HEAD),
        ]

    def validate(self, recipe: Any) -> list[str]:
        """CLIP and the head must be installed (file checks; nothing loads)."""
        return path_problems(self, recipe, self._specs())

    def hub_files(self) -> list[HubFiles]:
        """CLIP ViT-L/14 and the head, unless given by path."""
        return hub_files_of(self._specs())

    def setup(self, device: torch.device) -> None:
        """Load CLIP and the head onto ``device`` (once)."""
        if self._clip is not None:
            return
        device = torch.device(device)
        paths = resolve_specs(self.name, self._specs())
        head = load_aesthetic_head(paths["head"]).to(device)
        clip = HFClip.load(self.name, paths["clip_dir"], device, self.dtype)
        clip_model: Any = clip.model
        width = int(clip_model.config.projection_dim)
        if head.layers[0].in_features != width:
            raise ValueError(f"{self.name}: head expects {head.layers[0].in_features}-d embeddings, CLIP gives {width}")
        self._clip, self._head = clip, head

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return the predicted aesthetic score per image, fp32 on CPU."""
        check_images(self.name, images)
        if self._clip is None or self._head is None:
            raise RuntimeError(f"{self.name}: call setup(device) before score()")
        emb = self._clip.image_embeds(images)
        return check_scores(self.name, self._head(emb).squeeze(1))
