"""``digit-alignment`` and ``digit-judge``: a frozen digit classifier's probability that an image shows the digit its
prompt asked for. ``digit-alignment`` is the training reward; ``digit-judge`` (an independent CNN,
:mod:`rlpost_digits.judge`) is meant for evaluation only, as a second judge the policy never optimised.

``digits-brightness`` is a deliberately hackable demonstration reward (the mean pixel value): the policy can raise it
without drawing better digits, which is what the reward-hacking alarm (:mod:`rlpost.engine.evaluation.alarm`) must
catch (``recipes/ablations/digits_hackable_reward.yaml``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlpost import RewardSource
from rlpost_digits.data import digit_from_prompt

__all__ = ["DigitAlignmentReward", "DigitJudgeReward", "DigitsBrightnessReward", "requested_digit"]


def requested_digit(prompt: str, metadata: dict[str, Any], reward: str = "digit-alignment") -> int:
    """The digit a sample should show: ``metadata["digit"]`` if present, else the one digit its prompt names.

    Args:
        prompt: The sample's prompt.
        metadata: The prompt's metadata (``digit-prompts`` sets ``"digit"``).
        reward: Reward name for error messages.

    Raises:
        ValueError: When the metadata digit is not in 0..9, or there is no metadata digit and the prompt names none
            (or names several different ones).
    """
    if metadata.get("digit") is not None:
        d = metadata["digit"]
        if isinstance(d, bool) or not isinstance(d, int | str) or str(d).strip() not in {str(i) for i in range(10)}:
            raise ValueError(f"{reward}: metadata['digit'] must be an integer 0..9, got {d!r}")
        return int(d)
    parsed = digit_from_prompt(prompt)
    if parsed is None:
        raise ValueError(
            f"{reward}: cannot tell which digit {prompt!r} asks for: give metadata['digit'] (the 'digit-prompts'"
            " source does) or name exactly one digit in the prompt ('7' or 'seven')"
        )
    return parsed


class _DigitProbabilityReward(RewardSource):
    """Shared scoring: ``P(model sees the requested digit)`` for a frozen model with ``predict_proba_images``."""

    def __init__(self, path: str | None = None) -> None:
        self._path = path
        self._model: Any = None
        self._device = torch.device("cpu")

    @abstractmethod
    def _load(self, path: str | None, device: torch.device) -> Any:
        """The frozen model saved in ``path`` (``None``: the shipped asset), on ``device``."""

    def setup(self, device: torch.device) -> None:
        """Load the model onto ``device``."""
        self._device = torch.device(device)
        self._model = self._load(self._path, self._device)

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """``[S]`` float32 probabilities of the requested digits for ``[S, H, W, 3]`` uint8 ``images``."""
        if self._model is None:
            self.setup(self._device)
        if not (len(prompts) == len(metadata) == images.shape[0]):
            raise ValueError(f"{self.name}: {images.shape[0]} images, {len(prompts)} prompts, {len(metadata)} metadata")
        targets = torch.tensor([requested_digit(p, m, self.name) for p, m in zip(prompts, metadata, strict=True)])
        probs = self._model.predict_proba_images(images.to(self._device))
        scores: Tensor = probs.gather(1, targets.to(probs.device).unsqueeze(1)).squeeze(1).float().cpu()
        return scores


class DigitAlignmentReward(_DigitProbabilityReward):
    """Probability, under a frozen digits classifier, that each image shows the prompted digit (in ``[0, 1]``).

    Images are read the way the digits world draws them: bright strokes on a dark background, averaged to gray and
    area-resized to sklearn's 8x8 grid with values 0-16 (:func:`rlpost_digits.data.images_to_classifier_input`).

    Args:
        classifier: Directory of a classifier saved by ``python -m rlpost_digits.classifier``; ``None`` for the one
            shipped in ``assets/digits-classifier``.
    """

    name: ClassVar[str] = "digit-alignment"

    def __init__(self, classifier: str | None = None) -> None:
        super().__init__(classifier)
        self.classifier = classifier

    def _load(self, path: str | None, device: torch.device) -> Any:
        from rlpost_digits.classifier import load_classifier

        return load_classifier(path, device)


class DigitJudgeReward(_DigitProbabilityReward):
    """Probability, under the independent CNN judge, that each image shows the prompted digit (in ``[0, 1]``).

    A second judge for evaluation (``eval.judges``): another model family, preprocessing and training augmentation
    than ``digit-alignment``'s classifier (:mod:`rlpost_digits.judge`), so a rise in ``digit-alignment`` that
    ``digit-judge`` does not share points at reward hacking rather than better digits.

    Args:
        judge: Directory of a judge saved by ``python -m rlpost_digits.judge``; ``None`` for the one shipped in
            ``assets/digits-judge``.
    """

    name: ClassVar[str] = "digit-judge"

    def __init__(self, judge: str | None = None) -> None:
        super().__init__(judge)
        self.judge = judge

    def _load(self, path: str | None, device: torch.device) -> Any:
        from rlpost_digits.judge import load_judge

        return load_judge(path, device)


class DigitsBrightnessReward(RewardSource):
    """A deliberately hackable reward: each image's mean pixel value on ``[0, 1]``, whatever its prompt.

    Not a quality measure. It pays for ink (bright strokes on the digits world's dark background) and so for stroke
    mass, which a policy can maximise by brightening and thickening everything until the digit is unreadable. It exists
    to plant reward hacking on the digits world, so that the reward-hacking alarm
    (:mod:`rlpost.engine.evaluation.alarm`) can be shown to fire (``recipes/ablations/digits_hackable_reward.yaml``,
    ``docs/benchmarks.md``). Never use it to improve a model.
    """

    name: ClassVar[str] = "digits-brightness"

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """``[S]`` float32 mean pixel value of ``[S, H, W, 3]`` uint8 ``images``, in ``[0, 1]``."""
        if not (len(prompts) == len(metadata) == images.shape[0]):
            raise ValueError(f"{self.name}: {images.shape[0]} images, {len(prompts)} prompts, {len(metadata)} metadata")
        return (images.float() / 255.0).mean(dim=(1, 2, 3)).cpu()
