"""Wire format shared by the remote reward client and server: JSON with base64-encoded PNG images.

Never pickle: unpickling an HTTP body runs whatever code it names (the reward clients of
``yifan123/flow_grpo flow_grpo/rewards.py@ac4c86e`` and ``kvablack/ddpo-pytorch ddpo_pytorch/rewards.py@1958463``
``pickle.loads`` server responses). Request ``POST /score``::

    {"images": ["<base64 PNG>", ...], "prompts": ["...", ...], "metadata": [{...}, ...]}

Response ``200``: ``{"scores": [float, ...], "reward": "<name>"}``. Every failure, whatever its cause, is answered
with ``{"error": "<message>"}`` and a 4xx/5xx status (400 malformed, 401 token, 404 path, 408 body too slow,
411 no Content-Length, 413 over a limit, 500 scoring failed, 503 busy). ``GET /health`` answers
``{"status": "ok", "reward": "<name>", "limits": {...}}`` where ``limits`` holds the server's
:class:`WireLimits` so a client can split its batches to fit.

Images are checked from their PNG header (width and height are the first bytes of the ``IHDR`` chunk) *before*
any pixel is decompressed: a 20000x20000 all-black PNG is a few hundred kB on the wire and 1.2 GB once decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = [
    "MAX_JSON_DEPTH",
    "ImageLimitError",
    "WireLimits",
    "decode_images",
    "encode_images",
    "jsonable_metadata",
    "png_size",
]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_JSON_DEPTH = 32
"""Deepest nesting of JSON arrays/objects in a request or an answer: a request is 3 levels deep (object, metadata
list, metadata object) plus whatever nesting its metadata holds; ``json`` decodes recursively."""


class ImageLimitError(ValueError):
    """A request exceeds a size limit of the server (answered with HTTP 413)."""


@dataclass(frozen=True)
class WireLimits:
    """What one ``/score`` request may hold. The defaults fit a TreeGRPO step (54 images of 512x512) many times
    over while keeping one request's decoded pixels near 100 MB.

    Attributes:
        max_body_bytes: Largest request body (base64 PNGs are ~4/3 of the PNG size).
        max_images: Most images per request.
        max_pixels: Most pixels (width x height) in one image.
        max_total_pixels: Most pixels over all images of one request (3 bytes each once decoded).
        max_json_values: Most JSON values in one request body, keys included (a request needs about 3 per image plus
            what its metadata holds); counted before the body is parsed, so 4 MB of ``[{},{},...]`` is refused
            instead of becoming 1.3 million dicts. Each costs well under 100 bytes once parsed.
    """

    max_body_bytes: int = 64 * 1024 * 1024
    max_images: int = 256
    max_pixels: int = 4096 * 4096
    max_total_pixels: int = 32 * 1024 * 1024
    max_json_values: int = 65536

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def to_json(self) -> dict[str, int]:
        """JSON-ready dict (what ``/health`` reports)."""
        return asdict(self)


def encode_images(images: Tensor) -> list[str]:
    """``[S, H, W, 3]`` uint8 -> list of base64 PNG strings (lossless)."""
    out: list[str] = []
    for arr in images.detach().cpu().numpy():
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(arr), mode="RGB").save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's ``IHDR`` chunk, without decoding anything.

    Raises:
        ValueError: If ``data`` does not start like a PNG.
    """
    if len(data) < 24 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG (no PNG signature and IHDR header)")
    width, height = struct.unpack(">II", data[16:24])
    if width == 0 or height == 0:
        raise ValueError(f"empty PNG ({width}x{height})")
    return int(width), int(height)


def decode_images(items: Any, limits: WireLimits | None = None) -> Tensor:
    """List of base64 PNG strings -> ``[S, H, W, 3]`` uint8 (all images must share one size).

    Every size is checked against ``limits`` from the PNG headers before any image is decompressed.

    Raises:
        ImageLimitError: Too many images, or too many pixels in one image or in all of them.
        ValueError: Not a list of base64 PNG strings of one size (the message names the image index).
    """
    limits = limits or WireLimits()
    if not isinstance(items, list):
        raise ValueError(f"images: expected a list of base64 PNG strings, got {type(items).__name__}")
    if len(items) > limits.max_images:
        raise ImageLimitError(f"{len(items)} images in one request; the server's limit is {limits.max_images}")
    blobs: list[bytes] = []
    sizes: list[tuple[int, int]] = []
    total = 0
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ValueError(f"images[{i}]: expected a base64 string, got {type(item).__name__}")
        try:
            data = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"images[{i}]: not base64 ({err})") from None
        try:
            width, height = png_size(data)
        except ValueError as err:
            raise ValueError(f"images[{i}]: {err}") from None
        if width * height > limits.max_pixels:
            raise ImageLimitError(
                f"images[{i}] is {width}x{height} = {width * height} pixels; the server's limit is "
                f"{limits.max_pixels} pixels per image"
            )
        total += width * height
        if total > limits.max_total_pixels:
            raise ImageLimitError(
                f"images[0..{i}] hold {total} pixels; the server's limit is {limits.max_total_pixels} pixels per "
                "request (send fewer images per request)"
            )
        blobs.append(data)
        sizes.append((width, height))
    if len(set(sizes)) > 1:
        raise ValueError(f"images must share one size, got {sorted(set(sizes))} (width x height)")
    arrays: list[np.ndarray] = []
    for i, data in enumerate(blobs):
        try:
            with warnings.catch_warnings():
                # Our own limits above are the policy; Pillow's global bomb guard would only warn or disagree.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data), formats=["PNG"]) as img:
                    if img.size != sizes[i]:
                        raise ValueError(f"images[{i}]: header says {sizes[i]}, decoder says {img.size}")
                    arrays.append(np.asarray(img.convert("RGB")))
        except Image.DecompressionBombError as err:
            raise ImageLimitError(f"images[{i}]: {err}") from None
        except (OSError, SyntaxError, struct.error) as err:  # Pillow's errors for corrupt or truncated files
            raise ValueError(f"images[{i}]: corrupt PNG ({type(err).__name__}: {err})") from None
    if not arrays:
        return torch.zeros(0, 1, 1, 3, dtype=torch.uint8)
    return torch.from_numpy(np.stack(arrays))


def jsonable_metadata(metadata: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metadata made JSON-safe: values JSON cannot hold are sent as ``str(value)``."""
    return [json.loads(json.dumps(m, default=str)) for m in metadata]
