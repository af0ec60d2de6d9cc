from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from rlpost_rewards.jpeg import JpegCompressibility, JpegIncompressibility

from .conftest import make_images


def _pil_kb(arr: np.ndarray, quality: int = 95) -> float:
    buffer = io.BytesIO()
    Image.fromarray(arr).save(buffer, format="JPEG", quality=quality)
    return len(buffer.getvalue()) / 1000.0


def test_jpeg_rewards_match_direct_pil() -> None:
    images = make_images(6, size=48)
    expected = torch.tensor([_pil_kb(a) for a in images.numpy()])
    inc = JpegIncompressibility().score(images, [""] * 6, [{}] * 6)
    comp = JpegCompressibility().score(images, [""] * 6, [{}] * 6)
    torch.testing.assert_close(inc, expected)
    torch.testing.assert_close(comp, -expected)
    assert inc.dtype == torch.float32 and inc.shape == (6,)


def test_flat_image_is_more_compressible_than_noise() -> None:
    flat = torch.full((1, 64, 64, 3), 128, dtype=torch.uint8)
    noise = torch.randint(0, 256, (1, 64, 64, 3), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    reward = JpegCompressibility()
    assert reward.score(flat, [""], [{}]) > reward.score(noise, [""], [{}])


def test_quality_and_input_validation() -> None:
    with pytest.raises(ValueError, match="quality"):
        JpegCompressibility(quality=0)
    with pytest.raises(ValueError, match="uint8"):
        JpegCompressibility().score(torch.zeros(1, 8, 8, 3), [""], [{}])
    q50 = JpegIncompressibility(quality=50).score(make_images(1), [""], [{}])
    assert q50.item() == pytest.approx(_pil_kb(make_images(1).numpy()[0], 50))
