"""Helpers shared by the built-in reward sources: input checks, dtype names and batched CLIP-style preprocessing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "DTypeName",
    "check_images",
    "check_scores",
    "clip_preprocess",
    "load_state_dict_file",
    "to_dtype",
]

DTypeName = Literal["float32", "bfloat16", "float16"]

# OpenAI CLIP normalisation (open_clip.constants OPENAI_DATASET_MEAN/STD; also BLIP/ImageReward's transform).
OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)


def to_dtype(name: DTypeName) -> torch.dtype:
    """Map a recipe dtype name to a torch dtype."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def check_images(reward: str, images: Tensor, prompts: Sequence[str] | None = None) -> None:
    """Validate the ``score`` inputs: ``[S, H, W, 3]`` uint8 images and one prompt per image.

    Raises:
        ValueError: On a wrong dtype, shape or prompt count.
    """
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(
            f"{reward}: expected [S, H, W, 3] uint8 images, got dtype {images.dtype} shape {tuple(images.shape)}"
        )
    if prompts is not None and len(prompts) != images.shape[0]:
        raise ValueError(f"{reward}: {images.shape[0]} images but {len(prompts)} prompts")


def check_scores(reward: str, scores: Tensor) -> Tensor:
    """Return ``scores`` as a flat fp32 CPU tensor, raising if any value is not finite."""
    out = scores.detach().float().reshape(-1).cpu()
    if not torch.isfinite(out).all():
        raise ValueError(f"{reward}: non-finite scores {out.tolist()}")
    return out


def clip_preprocess(
    images: Tensor,
    size: int | Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    interpolation: str = "bicubic",
    resize_mode: str = "shortest",
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Batched tensor equivalent of open_clip's eval transform (``image_transform_v2(..., is_train=False)``).

    ``Resize(shortest side -> size, bicubic, antialias)`` -> ``CenterCrop(size)`` -> ``/255`` -> ``Normalize``.
    Resizing runs on uint8 tensors (rounded to uint8 like PIL) so results are close to, but not bit-identical
    with, the PIL pipeline of the anchors (algorithms.md 8.6); it is deterministic and per-image, so a batch gives
    the same values as single images.

    Args:
        images: ``[S, H, W, 3]`` uint8 images.
        size: Output side (int) or ``(height, width)``.
        mean: Per-channel normalisation mean.
        std: Per-channel normalisation std.
        interpolation: ``"bicubic"`` or ``"bilinear"``.
        resize_mode: ``"shortest"`` (resize shortest side then centre-crop) or ``"squash"`` (resize to size).
        device: Where to put the result (defaults to the images' device).
        dtype: Result dtype.

    Returns:
        ``[S, 3, h, w]`` normalised pixels.
    """
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF  # noqa: N812

    hw = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
    mode = InterpolationMode.BICUBIC if interpolation == "bicubic" else InterpolationMode.BILINEAR
    x = images.to(device) if device is not None else images
    x = x.permute(0, 3, 1, 2).contiguous()
    if resize_mode == "squash":
        x = TF.resize(x, list(hw), interpolation=mode, antialias=True)
    else:
        if resize_mode != "shortest":
            raise ValueError(f"unsupported resize_mode {resize_mode!r} (expected 'shortest' or 'squash')")
        h, w = x.shape[-2:]
        if hw[0] == hw[1]:
            # torchvision Resize(int): shortest side -> size, as open_clip's eval transform does for square sizes.
            if min(h, w) != hw[0]:
                x = TF.resize(x, [hw[0]], interpolation=mode, antialias=True)
        else:  # open_clip ResizeKeepRatio equivalent: scale so both sides cover the target, keep aspect ratio
            scale = max(hw[0] / h, hw[1] / w)
            x = TF.resize(x, [round(h * scale), round(w * scale)], interpolation=mode, antialias=True)
        x = TF.center_crop(x, list(hw))
    x = x.float().div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    return ((x - m) / s).to(dtype)


def load_state_dict_file(path: Any) -> dict[str, Tensor]:
    """Load tensors from ``.safetensors`` or, for anything else, ``torch.load(weights_only=True)`` (never pickle
    code execution; ecosystem.md 3.6). A ``{"state_dict": ...}`` wrapper is unwrapped."""
    p = str(path)
    if p.endswith(".safetensors"):
        from safetensors.torch import load_file

        return dict(load_file(p, device="cpu"))
    obj = torch.load(p, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ValueError(f"{p}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    return {str(k): v for k, v in obj.items()}
