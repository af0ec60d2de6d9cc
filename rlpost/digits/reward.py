"""``digit-alignment``: the classifier's probability that an image shows the digit its prompt asked for."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost.api import RewardSource
from rlpost.digits.data import digit_from_prompt

__all__ = ["DigitAlignmentReward", "requested_digit"]


def requested_digit(prompt: str, metadata: dict[str, Any]) -> int:
    """The digit a sample should show: ``metadata["digit"]`` if present, else the one digit its prompt names.

    Raises:
        ValueError: When the metadata digit is not in 0..9, or there is no metadata digit and the prompt names none
            (or names several different ones).
    """
    if metadata.get("digit") is not None:
        d = metadata["digit"]
        if isinstance(d, bool) or not isinstance(d, int | str) or str(d).strip() not in {str(i) for i in range(10)}:
            raise ValueError(f"digit-alignment: metadata['digit'] must be an integer 0..9, got {d!r}")
        return int(d)
    parsed = digit_from_prompt(prompt)
    if parsed is None:
        raise ValueError(
            f"digit-alignment: cannot tell which digit {prompt!r} asks for: give metadata['digit'] (the 'digit-prompts'"
            " source does) or name exactly one digit in the prompt ('7' or 'seven')"
        )
    return parsed


class DigitAlignmentReward(RewardSource):
    """Probability, under a frozen digits classifier, that each image shows the prompted digit (in ``[0, 1]``).

    Images are read the way the digits world draws them: bright strokes on a dark background, averaged to gray and
    area-resized to sklearn's 8x8 grid with values 0-16 (:func:`rlpost.digits.data.images_to_classifier_input`).

    Args:
        classifier: Directory of a classifier saved by ``python -m rlpost.digits.classifier``; ``None`` for the one
            shipped in ``assets/digits-classifier``.
    """

    name: ClassVar[str] = "digit-alignment"

    def __init__(self, classifier: str | None = None) -> None:
        self.classifier = classifier
        self._model: Any = None
        self._device = torch.device("cpu")

    def setup(self, device: torch.device) -> None:
        """Load the classifier onto ``device``."""
        from rlpost.digits.classifier import load_classifier

        self._device = torch.device(device)
        self._model = load_classifier(self.classifier, self._device)

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """``[S]`` float32 probabilities of the requested digits for ``[S, H, W, 3]`` uint8 ``images``."""
        if self._model is None:
            self.setup(self._device)
        if not (len(prompts) == len(metadata) == images.shape[0]):
            raise ValueError(
                f"digit-alignment: {images.shape[0]} images, {len(prompts)} prompts, {len(metadata)} metadata"
            )
        targets = torch.tensor([requested_digit(p, m) for p, m in zip(prompts, metadata, strict=True)])
        probs = self._model.predict_proba_images(images.to(self._device))
        scores: Tensor = probs.gather(1, targets.to(probs.device).unsqueeze(1)).squeeze(1).float().cpu()
        return scores
