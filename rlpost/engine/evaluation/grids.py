"""The evaluation's images: a captioned grid per set and evaluation (``eval/[<set>/]step_N.png``), the per-image PNGs
(``eval.save_images``) and the grids handed to the trackers.

Per-image PNGs hold the exact uint8 pixels (a video sample's frames stacked top to bottom, the layout the alarm's
image statistics read), which is what ``rlpost.apps.alarm_replay`` reads back.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from torch import Tensor

from rlpost.engine.evaluation.keys import image_dir
from rlpost.engine.logging_ import MetricsLogger
from rlpost.ops.images import save_grid, save_images, save_video_grid

__all__ = ["GRID_MAX_IMAGES", "log_grids", "save_set_images"]

GRID_MAX_IMAGES = 64
"""Most images in one ``eval/[<set>/]step_N.png`` grid (spread over the set); per-image PNGs keep every image."""


def save_set_images(
    images: Tensor, prompts: list[str], scores: dict[str, list[float]], directory: Path, per_image: bool
) -> None:
    """One set's captioned grid ``<directory>.png`` (prompt and every score per sample; a video sample as its frame
    strip; a video set also as the animated grid ``<directory>.gif``) and, with ``per_image``, its PNGs
    ``<directory>/NNNN.png`` (a video's frames stacked, plus ``NNNN.gif``: :func:`rlpost.ops.images.save_images`)
    from ``[N, F, H, W, 3]`` media."""
    # A benchmark-sized set (thousands of prompts) would make a grid of gigapixels: show a spread subset.
    n = len(prompts)
    g = GRID_MAX_IMAGES
    shown = list(range(n)) if n <= g else [i * (n - 1) // (g - 1) for i in range(g)]
    captions = [f"{prompts[i]} | " + " ".join(f"{column}={v[i]:.3g}" for column, v in scores.items()) for i in shown]
    save_grid(images[shown], captions, directory.with_suffix(".png"))
    if images.ndim == 5 and images.shape[1] > 1:  # a video model's set: also an animated grid, for the trackers
        save_video_grid(images[shown], captions, directory.with_suffix(".gif"))
    if per_image:
        save_images(images, directory)


def log_grids(logger: MetricsLogger, output_dir: Path, sets: Iterable[str], step: int) -> None:
    """Hand the grids the evaluation at ``step`` wrote to the trackers (``eval/grid``, ``eval/<set>/grid``; a video
    model's animated grids as ``eval/video``, ``eval/<set>/video``)."""
    for name in sets:
        grid = image_dir(output_dir, name, step).with_suffix(".png")
        if grid.is_file():
            logger.log_image(step, f"eval/{name}/grid" if name else "eval/grid", grid)
        if grid.with_suffix(".gif").is_file():
            logger.log_video(step, f"eval/{name}/video" if name else "eval/video", grid.with_suffix(".gif"))
