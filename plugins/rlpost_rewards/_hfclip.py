"""Shared transformers-``CLIPModel`` plumbing (LAION aesthetic, PickScore): load from a local directory only,
read the image preprocessing from ``preprocessor_config.json`` when present, return projected embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_preprocess

__all__ = ["HFClip", "features"]


def features(out: Any) -> Tensor:
    """Projected embeddings from ``get_image_features``/``get_text_features``: a tensor in transformers 4.x, a
    ``BaseModelOutputWithPooling`` whose ``pooler_output`` holds them in transformers 5."""
    if isinstance(out, Tensor):
        return out
    pooled: Tensor = out.pooler_output
    return pooled


class HFClip:
    """A transformers ``CLIPModel`` loaded from a local directory, with batched tensor preprocessing.

    Args:
        model: The CLIP model in eval mode.
        size: Crop side.
        mean: Normalisation mean.
        std: Normalisation std.
        device: Model device.
        dtype: Compute dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        size: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.size = size
        self.mean = mean
        self.std = std
        self.device = device
        self.dtype = dtype

    @classmethod
    def load(cls, reward: str, model_dir: Path, device: torch.device, dtype: torch.dtype) -> HFClip:
        """Load ``CLIPModel`` from ``model_dir`` with ``local_files_only=True`` (safetensors preferred)."""
        from transformers import CLIPModel

        model: Any = CLIPModel.from_pretrained(str(model_dir), local_files_only=True)
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        clip = cls(model, int(model.config.vision_config.image_size), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, device, dtype)
        return cls.load_preprocessing_from(clip, model_dir)

    @staticmethod
    def load_preprocessing_from(clip: HFClip, directory: Path) -> HFClip:
        """Take crop size, mean and std from ``directory/preprocessor_config.json`` when it exists.

        Raises:
            ValueError: When the file asks for something the batched preprocessing does not do (a resize target other
                than the crop size, a resampling filter other than bicubic), naming the field.
        """
        pp = directory / "preprocessor_config.json"
        if pp.is_file():
            cfg = json.loads(pp.read_text())
            crop = cfg.get("crop_size", clip.size)
            clip.size = int(crop["height"] if isinstance(crop, dict) else crop)
            resize = cfg.get("size", clip.size)
            resize = resize.get("shortest_edge", clip.size) if isinstance(resize, dict) else resize
            if int(resize) != clip.size:
                raise ValueError(
                    f"{pp}: size (shortest edge {resize}) must equal crop_size ({clip.size}); resizing to one size and "
                    "cropping to another is not supported"
                )
            if int(cfg.get("resample", 3)) != 3:  # PIL.Image.BICUBIC
                raise ValueError(f"{pp}: resample={cfg['resample']} is not supported (only 3, bicubic)")
            clip.mean = tuple(cfg.get("image_mean", clip.mean))
            clip.std = tuple(cfg.get("image_std", clip.std))
        return clip

    @torch.no_grad()
    def image_embeds(self, images: Tensor) -> Tensor:
        """L2-normalised fp32 projected image embeddings of ``[S, H, W, 3]`` uint8 images."""
        pixels = clip_preprocess(images, self.size, self.mean, self.std, device=self.device, dtype=self.dtype)
        model: Any = self.model
        emb = features(model.get_image_features(pixel_values=pixels)).float()
        out: Tensor = emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True)
        return out

    @torch.no_grad()
    def text_embeds(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """L2-normalised fp32 projected text embeddings."""
        model: Any = self.model
        out = model.get_text_features(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
        )
        emb = features(out).float()
        normed: Tensor = emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True)
        return normed
