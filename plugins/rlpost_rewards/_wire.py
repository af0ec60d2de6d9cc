"""Wire format shared by the remote reward client and server: JSON with base64-encoded PNG images.

Never pickle: unpickling an HTTP body runs whatever code it names (the reward clients of
``yifan123/flow_grpo flow_grpo/rewards.py@ac4c86e`` and ``kvablack/ddpo-pytorch ddpo_pytorch/rewards.py@1958463``
``pickle.loads`` server responses). Request ``POST /score``::

    {"images": ["<base64 PNG>", ...], "prompts": ["...", ...], "metadata": [{...}, ...]}

Response ``200``: ``{"scores": [float, ...], "reward": "<name>"}``; errors: ``{"error": "<message>"}`` with a
4xx/5xx status. ``GET /health`` answers ``{"status": "ok", "reward": "<name>"}``.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = ["decode_images", "encode_images", "jsonable_metadata"]


def encode_images(images: Tensor) -> list[str]:
    """``[S, H, W, 3]`` uint8 -> list of base64 PNG strings (lossless)."""
    out: list[str] = []
    for arr in images.detach().cpu().numpy():
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(arr), mode="RGB").save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def decode_images(items: list[str]) -> Tensor:
    """List of base64 PNG strings -> ``[S, H, W, 3]`` uint8 (all images must share one size)."""
    arrays: list[np.ndarray] = []
    for i, item in enumerate(items):
        with Image.open(io.BytesIO(base64.b64decode(item, validate=True))) as img:
            if img.format != "PNG":
                raise ValueError(f"image {i}: expected PNG, got {img.format}")
            arrays.append(np.asarray(img.convert("RGB")))
    if not arrays:
        return torch.zeros(0, 1, 1, 3, dtype=torch.uint8)
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"images must share one size, got {sorted(shapes)}")
    return torch.from_numpy(np.stack(arrays))


def jsonable_metadata(metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metadata made JSON-safe: values JSON cannot hold are sent as ``str(value)``."""
    import json

    return [json.loads(json.dumps(m, default=str)) for m in metadata]
