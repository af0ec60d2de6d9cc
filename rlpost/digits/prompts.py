"""``digit-prompts``: the digits world's prompt source (every template x every digit, with the digit as metadata)."""

from __future__ import annotations

from typing import Any, ClassVar

from rlpost.api import PromptSource
from rlpost.digits.data import HELDOUT_TEMPLATES, TRAIN_TEMPLATES, Split, format_prompt

__all__ = ["DigitsPrompts"]


class DigitsPrompts(PromptSource):
    """Prompts such as "a handwritten digit 7", each with metadata ``{"digit": 7, "template": "..."}``.

    The list is fixed (template-major, digits ascending); the core's prompt stream shuffles it per epoch from the
    run seed, so it is deterministic.

    Args:
        split: ``"train"``: the templates the model was pretrained with; ``"heldout"``: templates it never saw
            (for evaluating generalisation of a post-trained policy).
        templates: Custom templates instead of the split's, with ``{n}`` (numeral) and/or ``{word}`` (English word)
            placeholders, e.g. ``"a tiny {word}"``.
        digits: Only these digits (default all ten), e.g. ``[7]`` for a single-class run.
    """

    name: ClassVar[str] = "digit-prompts"

    def __init__(
        self,
        split: Split = "train",
        templates: list[str] | None = None,
        digits: list[int] | None = None,
    ) -> None:
        self.split = split
        self.templates = templates
        self.digits = digits

    def _templates(self) -> tuple[str, ...]:
        if self.templates is not None:
            return tuple(self.templates)
        if self.split == "train":
            return TRAIN_TEMPLATES
        if self.split == "heldout":
            return HELDOUT_TEMPLATES
        raise ValueError(f"digit-prompts: split must be 'train' or 'heldout', got {self.split!r}")

    def validate(self, recipe: Any) -> list[str]:
        """Check the split, the digits and that each template names the digit."""
        problems: list[str] = []
        if self.templates is None and self.split not in ("train", "heldout"):
            problems.append(f"prompts.init_args.split: must be 'train' or 'heldout', got {self.split!r}")
        for t in self.templates or []:
            if "{n}" not in t and "{word}" not in t:
                problems.append(f"prompts.init_args.templates: {t!r} has neither {{n}} nor {{word}}")
        if self.templates is not None and not self.templates:
            problems.append("prompts.init_args.templates: empty list")
        for d in self.digits or []:
            if not 0 <= d <= 9:
                problems.append(f"prompts.init_args.digits: {d} is not a digit 0..9")
        if self.digits is not None and not self.digits:
            problems.append("prompts.init_args.digits: empty list")
        return problems

    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """All ``(prompt, {"digit": d, "template": t})`` pairs.

        Raises:
            ValueError: For a bad split, digit or template (the messages of :meth:`validate`).
        """
        problems = self.validate(None)
        if problems:
            raise ValueError("; ".join(problems))
        digits = list(range(10)) if self.digits is None else list(self.digits)
        return [(format_prompt(t, d), {"digit": d, "template": t}) for t in self._templates() for d in digits]
