"""Sample grids and files: media with their prompt and reward as captions (PIL only).

Samples are media, ``[F, H, W, 3]`` uint8 frames each (``F = 1`` for images, :mod:`rlpost.ops.media`). In a grid a
sample is its frame strip (:func:`frame_strip`: up to :data:`STRIP_FRAMES` evenly spaced frames side by side; an
image is itself); on disk it is one lossless PNG of its frames stacked top to bottom (an image is itself, exactly as
before) and, for video, an animated GIF beside it for viewing; a video grid (:func:`save_video_grid`) is an animated
GIF of the captioned grids of each frame, which the trackers show as video.
"""

from __future__ import annotations

import math
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from rlpost.ops.media import as_media

__all__ = [
    "STRIP_FRAMES",
    "agg_pyplot",
    "frame_strip",
    "save_figure",
    "save_gif",
    "save_grid",
    "save_images",
    "save_video_grid",
]

STRIP_FRAMES = 4
"""Frames a video sample shows in a grid tile (first, last and evenly spaced between)."""
GIF_FPS = 8

_MIN_CELL = 128  # tiny test images (32 px) are upscaled so captions stay readable
_CAPTION_LINES = 3
_LINE_H = 12


def _wrap(text: str, width: int) -> list[str]:
    """Caption lines for a tile ``width`` pixels wide: at most :data:`_CAPTION_LINES`, wrapped between words.

    A number (any word with a digit: ``0.734``, ``r=0.71``, ``step_12``) is never split, not even when it is longer
    than a line (it then overruns the line rather than becoming unreadable); only digit-free words longer than a line
    (a URL, a run of letters) are cut. A ``"\n"`` starts a new line. Text that does not fit ends with ``…`` after the
    last whole word.
    """
    chars = max(8, width // 6)  # the default PIL font is about 6 px per character
    paragraphs = []
    for paragraph in text.split("\n"):
        words: list[str] = []
        for word in paragraph.split():
            if len(word) > chars and not any(c.isdigit() for c in word):
                words.extend(word[i : i + chars] for i in range(0, len(word), chars))
            else:
                words.append(word)
        paragraphs.append(" ".join(words))
    lines: list[str] = []
    for paragraph in paragraphs:
        lines.extend(textwrap.wrap(paragraph, chars, break_long_words=False, break_on_hyphens=False) or [""])
    if len(lines) > _CAPTION_LINES:
        last = " ".join(lines[_CAPTION_LINES - 1 :])
        kept = textwrap.wrap(last, chars, break_long_words=False, break_on_hyphens=False, max_lines=1, placeholder=" …")
        lines = [*lines[: _CAPTION_LINES - 1], kept[0] if kept else "…"]
    return lines


def frame_strip(clip: Tensor, max_frames: int = STRIP_FRAMES) -> Tensor:
    """``[F, H, W, 3]`` frames as one ``[H, k·W, 3]`` strip of ``k = min(F, max_frames)`` evenly spaced frames (the
    first and the last among them); one frame is returned as it is."""
    f = int(clip.shape[0])
    if f == 1:
        return clip[0]
    k = min(f, max_frames)
    picks = torch.linspace(0, f - 1, k).round().long()
    return torch.cat(list(clip[picks]), dim=1)


def save_grid(images: Tensor, captions: Sequence[str], path: Path, ncols: int | None = None) -> Path:
    """Write ``[B, F, H, W, 3]`` uint8 media (or ``[B, H, W, 3]`` images) as one captioned PNG grid, a video sample as
    its :func:`frame_strip`.

    Args:
        images: The media or images (any device).
        captions: One caption per sample (e.g. ``"a red cube | r=0.71"``); long ones are wrapped and cut.
        path: Output PNG path (parents are created).
        ncols: Columns; default ``ceil(sqrt(B))``.
    """
    media = as_media(images.detach().to("cpu", torch.uint8))
    imgs = torch.stack([frame_strip(clip) for clip in media]) if media.shape[0] else media[:, 0]
    grid = _grid_picture(imgs, captions, ncols)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def save_video_grid(media: Tensor, captions: Sequence[str], path: Path, ncols: int | None = None) -> Path:
    """Write ``[B, F, H, W, 3]`` uint8 media as one animated GIF grid: frame ``t`` of the GIF is the captioned grid
    (:func:`save_grid`'s layout) of every sample's frame ``t``, so the trackers can show the samples as video.

    Args:
        media: The videos (any device; all of one length).
        captions: One caption per sample.
        path: Output GIF path (parents are created).
        ncols: Columns; default ``ceil(sqrt(B))``.
    """
    clips = as_media(media.detach().to("cpu", torch.uint8))
    frames = [np.asarray(_grid_picture(clips[:, t], captions, ncols)) for t in range(int(clips.shape[1]))]
    return save_gif(torch.from_numpy(np.stack(frames)), path)


def _grid_picture(imgs: Tensor, captions: Sequence[str], ncols: int | None) -> Image.Image:
    """``[B, H, W, 3]`` uint8 CPU images tiled ``ncols`` wide, each captioned below (tiny images upscaled)."""
    n = int(imgs.shape[0])
    if n == 0:
        raise ValueError("save_grid: no images")
    cols = ncols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    h, w = int(imgs.shape[1]), int(imgs.shape[2])
    scale = max(1, math.ceil(_MIN_CELL / max(h, w)))
    cw, ch = w * scale, h * scale
    cap_h = _CAPTION_LINES * _LINE_H + 4
    grid = Image.new("RGB", (cols * cw, rows * (ch + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = c * cw, r * (ch + cap_h)
        tile = Image.fromarray(imgs[i].numpy()).resize((cw, ch), Image.Resampling.NEAREST)
        grid.paste(tile, (x, y))
        for j, line in enumerate(_wrap(captions[i] if i < len(captions) else "", cw)):
            draw.text((x + 2, y + ch + 2 + j * _LINE_H), line, fill="black", font=font)
    return grid


def save_images(images: Tensor, directory: Path, prefix: str = "") -> list[Path]:
    """Write each sample of ``[B, F, H, W, 3]`` uint8 media (or ``[B, H, W, 3]`` images) as
    ``<prefix><index:04d>.png``: lossless, for exact comparisons, its ``F`` frames stacked top to bottom
    (``[F·H, W, 3]``; an image is itself). A video sample also gets ``<prefix><index:04d>.gif`` (:func:`save_gif`).

    Returns:
        The PNG paths.
    """
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, clip in enumerate(as_media(images.detach().to("cpu", torch.uint8))):
        p = directory / f"{prefix}{i:04d}.png"
        Image.fromarray(clip.reshape(-1, *clip.shape[2:]).numpy()).save(p)
        if clip.shape[0] > 1:
            save_gif(clip, p.with_suffix(".gif"))
        paths.append(p)
    return paths


def save_gif(frames: Tensor, path: Path, fps: int = GIF_FPS) -> Path:
    """Write ``[F, H, W, 3]`` uint8 frames as an animated GIF that loops (for viewing: GIF has 256 colours per frame,
    the PNGs are the exact pixels)."""
    pictures = [Image.fromarray(f.numpy()) for f in frames.detach().to("cpu", torch.uint8)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=max(1, round(1000 / fps)), loop=0)
    return path


def agg_pyplot(skipping: str) -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend (never needs a display: safe in worker processes and CI).

    Args:
        skipping: The warning to give when matplotlib is missing, naming the tool and what it skips.

    Returns:
        The ``pyplot`` module, or ``None`` after a ``UserWarning`` (``skipping``) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(skipping, UserWarning, stacklevel=3)
        return None
    return plt


def save_figure(fig: Any, out: Path) -> Path:
    """Lay out ``fig`` tightly and write it to ``out`` (parent folders created); the caller closes it."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
