"""rlpost/ops/media.py: how rewards score media. One-frame media score bit for bit as the images they are, an image
reward's frame scores reduce per sample by mean / min / first, a "video" reward gets whole clips, NaN propagates
through the reduction, wrong score counts are refused, and image-only rewards are refused for video models."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from rlpost.core.api import RewardSource
from rlpost.models.sd3 import SD3Policy
from rlpost.models.wan import WanPolicy
from rlpost.ops.media import (
    FrameScoring,
    as_media,
    expected_scores,
    media_problems,
    reduce_frames,
    reward_inputs,
    score_media,
    stack_frames,
)
from rlpost_rewards.jpeg import JpegCompressibility


class PlantedFrameReward(RewardSource):
    """Scores an image by its top-left red value / 10: the tests plant each frame's score in that pixel. Records the
    prompts and metadata it was called with."""

    name: ClassVar[str] = "planted"

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], list[str], list[dict[str, Any]]]] = []

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        self.calls.append((tuple(images.shape), list(prompts), list(metadata)))
        values = images[:, 0, 0, 0].float() / 10
        return torch.where(images[:, 0, 0, 1] == 255, torch.nan, values)  # green 255 plants a NaN score


class ClipReward(PlantedFrameReward):
    """A "video" reward: one score per clip, its frame count times its first frame's planted value."""

    name: ClassVar[str] = "clip"
    media_scope: ClassVar[Any] = "video"

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        self.calls.append((tuple(images.shape), list(prompts), list(metadata)))
        return images.shape[1] * images[:, 0, 0, 0, 0].float()


class StillReward(PlantedFrameReward):
    name: ClassVar[str] = "still"
    media_scope: ClassVar[Any] = "image"


# Planted per-frame scores of 3 samples x 4 frames (x 10 in the red channel).
PLANTED = torch.tensor([[1.0, 5.0, 3.0, 2.0], [4.0, 4.0, 4.0, 4.0], [9.0, 0.0, 6.0, 7.0]])
PROMPTS = ["a cat", "a dog", "a fox"]
META = [{"i": 0}, {"i": 1}, {"i": 2}]


def _media(planted: Tensor = PLANTED) -> Tensor:
    s, f = planted.shape
    gen = torch.Generator().manual_seed(0)
    media = torch.randint(0, 200, (s, f, 8, 6, 3), dtype=torch.uint8, generator=gen)
    media[:, :, 0, 0, 0] = (planted * 10).to(torch.uint8)
    return media


def test_one_frame_media_score_bit_identical_to_images() -> None:
    """An image model's samples are one-frame media: every reduction gives exactly what ``score`` gives the images,
    with the prompts and metadata unchanged."""
    images = torch.randint(0, 256, (5, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    prompts, meta = [f"p{i}" for i in range(5)], [{"k": i} for i in range(5)]
    for reward in (JpegCompressibility(), PlantedFrameReward()):
        direct = reward.score(images, prompts, meta).float()
        for reduction in ("mean", "min", "first"):
            got = score_media(reward, as_media(images), prompts, meta, reduction)
            assert torch.equal(got, direct), (reward.name, reduction)
    planted = PlantedFrameReward()
    score_media(planted, as_media(images), prompts, meta)
    assert planted.calls == [((5, 16, 16, 3), prompts, meta)]


@pytest.mark.parametrize(
    ("reduction", "expected"),
    [("mean", PLANTED.mean(1)), ("min", PLANTED.min(1).values), ("first", PLANTED[:, 0])],
)
def test_reductions_of_planted_frame_scores(reduction: Any, expected: Tensor) -> None:
    reward = PlantedFrameReward()
    got = score_media(reward, _media(), PROMPTS, META, reduction)
    torch.testing.assert_close(got, expected)
    ((shape, prompts, meta),) = reward.calls
    if reduction == "first":  # only frame 0 is scored
        assert shape == (3, 8, 6, 3) and prompts == PROMPTS and meta == META
    else:  # every frame, its sample's prompt and metadata repeated per frame
        assert shape == (12, 8, 6, 3)
        assert prompts == [p for p in PROMPTS for _ in range(4)] and meta == [m for m in META for _ in range(4)]


def test_first_scores_the_first_frame_itself() -> None:
    media = _media()
    inputs, _, _ = reward_inputs(PlantedFrameReward(), media, PROMPTS, META, "first")
    assert torch.equal(inputs, media[:, 0])
    assert torch.equal(stack_frames(media)[:, :8], media[:, 0])  # the stacked PNG layout starts with frame 0
    assert stack_frames(media).shape == (3, 32, 6, 3)


def test_video_reward_gets_clips() -> None:
    reward = ClipReward()
    media = _media()
    for reduction in ("mean", "min", "first"):  # the reduction applies to image rewards only
        got = score_media(reward, media, PROMPTS, META, reduction)
        torch.testing.assert_close(got, 4 * PLANTED[:, 0] * 10)
        assert expected_scores(reward, media, reduction) == 3
    assert {c[0] for c in reward.calls} == {(3, 4, 8, 6, 3)} and all(c[1] == PROMPTS for c in reward.calls)


def test_nan_frame_scores_propagate() -> None:
    """A frame the reward cannot score (NaN) makes its sample's mean and min NaN, so the engine's guards see it; the
    other samples keep their scores, and ``first`` is NaN only where frame 0 is."""
    media = _media()
    media[0, 2, 0, 0, 1] = 255  # sample 0, frame 2
    media[2, 0, 0, 0, 1] = 255  # sample 2, frame 0
    for reduction in ("mean", "min"):
        got = score_media(PlantedFrameReward(), media, PROMPTS, META, reduction)
        assert torch.isnan(got[0]) and torch.isnan(got[2]) and got[1] == 4.0, reduction
    first = score_media(PlantedFrameReward(), media, PROMPTS, META, "first")
    assert first[0] == 1.0 and first[1] == 4.0 and torch.isnan(first[2])
    raw = torch.tensor([1.0, torch.nan, 2.0, 3.0])
    assert torch.isnan(reduce_frames(raw, PlantedFrameReward(), torch.zeros(2, 2, 1, 1, 3), "min")[0])


def test_wrong_number_of_scores_is_refused() -> None:
    class Short(PlantedFrameReward):
        def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
            return torch.zeros(images.shape[0] - 1)

    with pytest.raises(ValueError, match=r"returned \[11\], expected 12 scores"):
        score_media(Short(), _media(), PROMPTS, META)


def test_image_only_rewards_are_refused_for_video_models() -> None:
    """Checked on the adapters' frame counts without loading: Wan's 9 frames refuse a "image" reward (naming the
    field), SD3's single frame accepts it; per-frame and video rewards are accepted either way."""
    wan = WanPolicy("tiny-random", height=32, width=48, num_frames=9)
    rewards = [("rewards[0]", PlantedFrameReward()), ("eval.judges[1]", StillReward()), ("rewards[2]", ClipReward())]
    (problem,) = media_problems(wan, rewards)
    assert problem.startswith("eval.judges[1]: reward 'still' scores single images only")
    assert "9-frame videos model 'wan'" in problem
    assert media_problems(SD3Policy("tiny-random", resolution=32), rewards) == []
    assert FrameScoring("min").problems() == []
    assert FrameScoring("median").problems()[0].startswith("reduction: must be one of mean, min, first")  # type: ignore[arg-type]
