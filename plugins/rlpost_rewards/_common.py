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
    float_resize: bool = False,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Batched tensor equivalent of the CLIP-style eval transforms the reward models were released with.

    ``resize_mode="shortest"`` is open_clip's eval transform (``image_transform_v2(..., is_train=False)``) and
    CLIP's/transformers' processors: ``Resize(shortest side -> size, bicubic, antialias)`` -> ``CenterCrop(size)``.
    ``"squash"`` resizes to ``size`` ignoring the aspect ratio. ``"longest"`` is HPSv2's ``ResizeMaxSize``
    (``tgxs002/HPSv2 hpsv2/src/open_clip/transform.py@866735e``): longest side -> size, then zero padding (black,
    before normalisation) split evenly with the odd pixel right/bottom; unlike upstream it also pads an image whose
    longest side already equals ``size``, which upstream would leave non-square. Then ``/255`` -> ``Normalize``.

    By default resizing runs on uint8 tensors (rounded to uint8, as PIL does), so results are close to, but not
    bit-identical with, the PIL pipelines of CLIP/transformers/open_clip; ``float_resize=True`` converts to [0, 1]
    floats first, as HPSv2's ``ToTensor`` -> ``ResizeMaxSize`` does. Per-image and deterministic, so a batch gives
    the same values as single images.

    Args:
        images: ``[S, H, W, 3]`` uint8 images.
        size: Output side (int) or ``(height, width)``; ``"longest"`` needs a square size.
        mean: Per-channel normalisation mean.
        std: Per-channel normalisation std.
        interpolation: ``"bicubic"`` or ``"bilinear"``.
        resize_mode: ``"shortest"``, ``"squash"`` or ``"longest"`` (see above).
        float_resize: Resize ``[0, 1]`` floats instead of uint8.
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
    if float_resize:
        x = x.float().div_(255.0)
    h, w = x.shape[-2:]
    if resize_mode == "squash":
        x = TF.resize(x, list(hw), interpolation=mode, antialias=True)
    elif resize_mode == "longest":
        if hw[0] != hw[1]:
            raise ValueError(f"resize_mode 'longest' needs a square size, got {hw}")
        scale = hw[0] / max(h, w)
        new_h, new_w = round(h * scale), round(w * scale)
        if scale != 1.0:
            x = TF.resize(x, [new_h, new_w], interpolation=mode, antialias=True)
        pad_h, pad_w = hw[0] - new_h, hw[1] - new_w
        if pad_h or pad_w:
            x = TF.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    elif resize_mode == "shortest":
        if hw[0] == hw[1]:
            # torchvision Resize(int): shortest side -> size, as open_clip's eval transform does for square sizes.
            if min(h, w) != hw[0]:
                x = TF.resize(x, [hw[0]], interpolation=mode, antialias=True)
        else:  # open_clip ResizeKeepRatio equivalent: scale so both sides cover the target, keep aspect ratio
            scale = max(hw[0] / h, hw[1] / w)
            x = TF.resize(x, [round(h * scale), round(w * scale)], interpolation=mode, antialias=True)
        x = TF.center_crop(x, list(hw))
    else:
        raise ValueError(f"unsupported resize_mode {resize_mode!r} (expected 'shortest', 'squash' or 'longest')")
    if not float_resize:
        x = x.float().div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    out: Tensor = ((x - m) / s).to(dtype)
    return out


def load_state_dict_file(path: Any) -> dict[str, Tensor]:
    """Load tensors from ``.safetensors`` or, for anything else, ``torch.load(weights_only=True)`` (never pickle
    code execution). A ``{"state_dict": ...}`` wrapper is unwrapped."""
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
