"""JPEG (in)compressibility rewards from DDPO (``ddpo_pytorch/rewards.py``: ``jpeg_compressibility`` /
``jpeg_incompressibility``): the size in kB of each image saved as JPEG at quality 95 with PIL, negated for
compressibility. No weights; deterministic for a given PIL/libjpeg build."""

from __future__ import annotations

import io
from typing import Annotated, Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rlpost import Range, RewardSource

from ._common import check_images

__all__ = ["JpegCompressibility", "JpegIncompressibility", "jpeg_size_kb"]


def jpeg_size_kb(images: Tensor, quality: int = 95) -> Tensor:
    """Size of each ``[H, W, 3]`` uint8 image as a PIL JPEG at ``quality``, in kB (bytes / 1000, as in DDPO).

    Args:
        images: ``[S, H, W, 3]`` uint8 images.
        quality: JPEG quality (DDPO uses 95).

    Returns:
        ``[S]`` fp32 sizes in kB.
    """
    arrays = images.detach().cpu().numpy()
    sizes: list[float] = []
    for arr in arrays:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(arr)).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility(RewardSource):
    """``-(JPEG size in kB)``: rewards images that compress well (DDPO's compressibility task).

    Args:
        quality: JPEG quality used for the size measurement.
    """

    name: ClassVar[str] = "jpeg-compressibility"
    sign: ClassVar[float] = -1.0  # the score is sign * size_kb

    def __init__(self, quality: Annotated[int, Range(ge=1, le=100)] = 95) -> None:
        self.quality = quality

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return ``sign * size_kb`` per image."""
        check_images(self.name, images)
        return self.sign * jpeg_size_kb(images, self.quality)


class JpegIncompressibility(JpegCompressibility):
    """``+(JPEG size in kB)``: rewards detailed, hard-to-compress images (DDPO's incompressibility task).

    Args:
        quality: JPEG quality used for the size measurement.
    """

    name: ClassVar[str] = "jpeg-incompressibility"
    sign: ClassVar[float] = 1.0
