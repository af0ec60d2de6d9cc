"""Media: every decoded sample is ``[F, H, W, 3]`` uint8 frames (``F = 1`` for an image model), and rewards score them.

Image rewards (``RewardSource.media_scope`` ``"frames"``, the default) score images: a sample's ``F`` frames go to
``score`` as ``F`` images (its prompt and metadata repeated for each), and the sample's score is the mean of its
frames' scores (``reward_frames.reduction: mean``, the default), their minimum (``min``: a clip is as good as its
worst frame), or the first frame's score alone (``first``: only frame 0 is scored). A ``"video"`` reward gets whole
clips and returns one score per clip. An image model's samples are one-frame clips, so they take exactly this path:
``F = 1`` images, and the mean of one score is that score, bit for bit.

``first`` is DanceGRPO's Wan2.1 reward: its trainer writes each sampled video to MP4 and scores the first frame with
HPS-v2.1 (``fastvideo/train_grpo_wan_2_1.py`` @15cc71d, ``video_first_frame_to_pil``); ``mean`` and ``min`` are ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from rlpost.core.api import Policy, RewardSource

__all__ = [
    "FRAME_REDUCTIONS",
    "FrameReduction",
    "FrameScoring",
    "as_media",
    "expected_scores",
    "media_problems",
    "reduce_frames",
    "reward_inputs",
    "score_media",
    "stack_frames",
]

FrameReduction = Literal["mean", "min", "first"]
FRAME_REDUCTIONS: tuple[str, ...] = ("mean", "min", "first")


@dataclass
class FrameScoring:
    """How an image reward's per-frame scores become one score per video sample (recipe section ``reward_frames``).

    Attributes:
        reduction: ``mean`` (default) or ``min`` of a sample's frame scores, or ``first``: score frame 0 only
            (DanceGRPO's Wan2.1 reward). Images (one frame) are unaffected by the choice.
    """

    reduction: FrameReduction = "mean"

    def problems(self) -> list[str]:
        """Range problems, each naming its field relative to the section."""
        if self.reduction not in FRAME_REDUCTIONS:
            return [f"reduction: must be one of {', '.join(FRAME_REDUCTIONS)}, got {self.reduction!r}"]
        return []


def reward_inputs(
    reward: RewardSource,
    media: Tensor,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    reduction: FrameReduction = "mean",
) -> tuple[Tensor, list[str], list[dict[str, Any]]]:
    """What ``reward.score`` is called with for ``[S, F, H, W, 3]`` media: the clips for a ``"video"`` reward, each
    sample's first frame with ``first``, else the ``S·F`` frames with each sample's prompt and metadata repeated per
    frame."""
    if reward.media_scope == "video":
        return media, list(prompts), list(metadata)
    if reduction == "first":
        return media[:, 0], list(prompts), list(metadata)
    f = int(media.shape[1])
    return (
        media.flatten(0, 1),
        [p for p in prompts for _ in range(f)],
        [m for m in metadata for _ in range(f)],
    )


def expected_scores(reward: RewardSource, media: Tensor, reduction: FrameReduction = "mean") -> int:
    """How many scores ``reward.score`` must return for :func:`reward_inputs`."""
    s, f = int(media.shape[0]), int(media.shape[1])
    return s if reward.media_scope == "video" or reduction == "first" else s * f


def reduce_frames(values: Tensor, reward: RewardSource, media: Tensor, reduction: FrameReduction = "mean") -> Tensor:
    """One score per sample from what ``reward.score`` returned on :func:`reward_inputs`: a video reward's as is, an
    image reward's ``[S·F]`` frame scores reduced over each sample's frames (``mean`` or ``min``; NaN propagates)."""
    if reward.media_scope == "video" or reduction == "first":
        return values
    per_sample = values.reshape(int(media.shape[0]), int(media.shape[1]))
    return per_sample.mean(1) if reduction == "mean" else per_sample.amin(1)


def score_media(
    reward: RewardSource,
    media: Tensor,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    reduction: FrameReduction = "mean",
) -> Tensor:
    """``reward``'s ``[S]`` scores of ``[S, F, H, W, 3]`` media: :func:`reward_inputs`, ``score``, then
    :func:`reduce_frames`.

    Raises:
        ValueError: The reward returned another number of scores than it was given images or clips.
    """
    raw = reward.score(*reward_inputs(reward, media, prompts, metadata, reduction))
    n = expected_scores(reward, media, reduction)
    if not isinstance(raw, Tensor) or raw.shape != (n,):
        got = list(raw.shape) if isinstance(raw, Tensor) else type(raw).__name__
        raise ValueError(f"reward {reward.name!r} returned {got}, expected {n} scores")
    return reduce_frames(raw.float(), reward, media, reduction)


def media_problems(policy: Policy, rewards: Sequence[tuple[str, RewardSource]]) -> list[str]:
    """Rewards that cannot score what ``policy`` generates: an image-only reward (``media_scope = "image"``) when the
    model decodes several frames per sample. ``rewards`` pairs each reward with its recipe field (``rewards[0]``),
    which its problem names."""
    frames = int(policy.frames)
    if frames <= 1:
        return []
    return [
        f"{where}: reward {r.name!r} scores single images only (media_scope 'image') and cannot score the "
        f"{frames}-frame videos model {policy.name!r} generates; use a reward that scores frames or video"
        for where, r in rewards
        if r.media_scope == "image"
    ]


def as_media(images: Tensor) -> Tensor:
    """``[N, H, W, 3]`` images as one-frame media ``[N, 1, H, W, 3]``; media ``[N, F, H, W, 3]`` pass through.

    Raises:
        ValueError: Neither shape.
    """
    if images.ndim == 5:
        return images
    if images.ndim != 4:
        raise ValueError(f"expected [N, H, W, 3] images or [N, F, H, W, 3] media, got {list(images.shape)}")
    return images.unsqueeze(1)


def stack_frames(media: Tensor) -> Tensor:
    """``[N, F, H, W, 3]`` media as ``[N, F·H, W, 3]`` images, each sample's frames top to bottom: the layout of the
    saved PNGs (:func:`rlpost.ops.images.save_images`) and what image statistics read (one-frame media: the images)."""
    n, f, h, w, c = media.shape
    return media.reshape(n, f * h, w, c)
