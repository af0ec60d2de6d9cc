"""The digits world's data: scikit-learn's ``load_digits`` images, a fixed train/held-out split and prompt templates.

``load_digits`` ships inside scikit-learn (1,797 8x8 grayscale images, values 0-16, bright strokes on a dark
background, labels 0-9), so everything here works offline. The split is by index (every fifth image is held out), not
by a random generator, so it cannot change with library versions.

Images keep sklearn's orientation everywhere: **bright (white) strokes on a dark (black) background**. The generator
is trained on that orientation and the classifier reads it back.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DIGIT_WORDS",
    "EVAL_TEMPLATES",
    "PROMPT_SPLITS",
    "RESOLUTION",
    "RL_TEMPLATES",
    "TRAIN_TEMPLATES",
    "PromptSplit",
    "Split",
    "digit_from_prompt",
    "format_prompt",
    "images_to_classifier_input",
    "load_split",
    "prompts_for",
    "upsample_digits",
]

Split = Literal["train", "heldout"]
"""Image splits of sklearn's digits (:func:`load_split`)."""
PromptSplit = Literal["pretrain", "train", "rl", "eval"]
"""Template splits of the prompts (:data:`PROMPT_SPLITS`); ``train`` is the older name of ``pretrain``."""

RESOLUTION = 16
"""Image size of the digits world in pixels (8x8 sklearn digits upsampled 2x)."""

DIGIT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# ``{n}`` is the numeral ("7"), ``{word}`` the English word ("seven"). Each template split mixes both forms. The three
# splits are disjoint sentence frames around the same digit tokens:
#   pretrain: the only templates the generator saw in pretraining (rlpost_digits.pretrain);
#   rl:       never seen in pretraining; RL post-training trains on them (the base model leaves headroom there);
#   eval:     never seen in pretraining nor in RL; evaluation only, to measure transfer to unseen phrasings.
# Every word is in the shipped T5 vocabulary (rlpost_digits.pretrain._EXTRA_T5_WORDS and rlpost.models.tiny_text) and
# every prompt fits both token budgets, so no prompt is truncated (tests/unit/digits/test_digits.py checks this).
TRAIN_TEMPLATES: tuple[str, ...] = (
    "a handwritten digit {n}",
    "the number {word}",
    "a digit {n} written by hand",
    "the digit {word}",
    "a drawing of the number {n}",
    "a handwritten {word}",
)
RL_TEMPLATES: tuple[str, ...] = (
    "a picture of the digit {word}",
    "the handwritten number {n}",
    "a {word} drawn by hand",
)
EVAL_TEMPLATES: tuple[str, ...] = (
    "an image of the numeral {n}",
    "the figure {word} written by hand",
    "a small handwritten {n}",
    "the numeral {word}",
)
PROMPT_SPLITS: dict[str, tuple[str, ...]] = {
    "pretrain": TRAIN_TEMPLATES,
    "train": TRAIN_TEMPLATES,
    "rl": RL_TEMPLATES,
    "eval": EVAL_TEMPLATES,
}
"""Template split name -> templates (``train`` is kept as the older name of ``pretrain``)."""


def format_prompt(template: str, digit: int) -> str:
    """Fill a template's ``{n}`` (numeral) and ``{word}`` (English word) placeholders with ``digit``."""
    if not 0 <= digit <= 9:
        raise ValueError(f"digit must be in 0..9, got {digit}")
    return template.format(n=str(digit), word=DIGIT_WORDS[digit])


def prompts_for(templates: tuple[str, ...] | list[str], digits: range | list[int] = range(10)) -> list[tuple[str, int]]:
    """All ``(prompt, digit)`` pairs of ``templates`` x ``digits``, template-major."""
    return [(format_prompt(t, d), d) for t in templates for d in digits]


_WORD_TO_DIGIT = {w: i for i, w in enumerate(DIGIT_WORDS)}
_DIGIT_RE = re.compile(r"(?<![0-9])([0-9])(?![0-9])|\b(" + "|".join(DIGIT_WORDS) + r")\b", re.IGNORECASE)


def digit_from_prompt(prompt: str) -> int | None:
    """The digit a prompt asks for: a lone numeral (``"7"``) or an English number word (``"seven"``).

    Returns:
        The digit, or ``None`` when the prompt names no digit or names several different ones.
    """
    found = set()
    for m in _DIGIT_RE.finditer(prompt):
        found.add(int(m.group(1)) if m.group(1) is not None else _WORD_TO_DIGIT[m.group(2).lower()])
    return found.pop() if len(found) == 1 else None


@lru_cache(maxsize=1)
def _load_all() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)


def load_split(split: Split | Literal["all"]) -> tuple[Tensor, Tensor]:
    """The sklearn digits of one split.

    Args:
        split: ``"heldout"`` = every fifth image (index % 5 == 0, 360 images), ``"train"`` = the other 1,437,
            ``"all"`` = all 1,797.

    Returns:
        ``[N, 8, 8]`` float32 images with sklearn's values 0-16, and ``[N]`` int64 labels.
    """
    images, labels = _load_all()
    idx = np.arange(len(labels))
    if split == "train":
        idx = idx[idx % 5 != 0]
    elif split == "heldout":
        idx = idx[idx % 5 == 0]
    elif split != "all":
        raise ValueError(f"unknown split {split!r} (train, heldout, all)")
    return torch.from_numpy(images[idx].copy()), torch.from_numpy(labels[idx].copy())


def upsample_digits(images: Tensor, resolution: int = RESOLUTION) -> Tensor:
    """sklearn 8x8 digits (0-16) -> ``[N, 1, R, R]`` pixels in ``[-1, 1]`` (bilinear; bright strokes stay bright).

    This is the generator's pixel space: the identity VAE (see :mod:`rlpost_digits.pretrain`) decodes a latent of
    this form to the same values on all three RGB channels.
    """
    x = images.float().unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(resolution, resolution), mode="bilinear", align_corners=False)
    return (x * 2 - 1).clamp(-1, 1)


def images_to_classifier_input(images: Tensor) -> Tensor:
    """``[S, H, W, 3]`` uint8 RGB images -> ``[S, 64]`` float32 features on sklearn's 8x8, 0-16 scale.

    Grayscale is the channel mean; the image is area-averaged down to 8x8 (for the 16x16 world that is 2x2 average
    pooling, which undoes :func:`upsample_digits` up to bilinear blur), and 255 maps to 16, the sklearn maximum.
    """
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected [S, H, W, 3] images, got shape {tuple(images.shape)}")
    x = images.float().mean(dim=-1, keepdim=True).permute(0, 3, 1, 2) / 255.0
    x = F.interpolate(x, size=(8, 8), mode="area")
    return (x * 16.0).reshape(x.shape[0], 64)


def digits_to_uint8_rgb(images: Tensor, resolution: int = RESOLUTION) -> Tensor:
    """sklearn 8x8 digits -> ``[N, R, R, 3]`` uint8, exactly as the pipeline would decode a perfect sample."""
    x = upsample_digits(images, resolution)
    u8 = ((x / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return u8.permute(0, 2, 3, 1).expand(-1, -1, -1, 3).contiguous()
