"""``digit-prompts``: the digits world's prompt source (every template x every digit, with the digit as metadata)."""

from __future__ import annotations

from typing import Any, ClassVar

from rlpost import PromptSource
from rlpost_digits.data import PROMPT_SPLITS, PromptSplit, format_prompt

__all__ = ["DigitsPrompts"]

_RENAMED = {
    "heldout": "split 'heldout' was split in two: use 'rl' (never seen in pretraining, for RL training; the former "
    "'heldout' templates) or 'eval' (never seen in pretraining nor RL, for evaluation)"
}


class DigitsPrompts(PromptSource):
    """Prompts such as "a handwritten digit 7", each with metadata ``{"digit": 7, "template": "..."}``.

    The list is fixed (template-major, digits ascending); the core's prompt stream shuffles it per epoch from the
    run seed, so it is deterministic.

    Args:
        split: Which disjoint template set (``rlpost_digits.data``): ``"pretrain"`` (or its older name ``"train"``):
            the templates the model was pretrained with; ``"rl"``: templates it never saw, to post-train on;
            ``"eval"``: templates it never saw and RL does not train on, to evaluate transfer.
        templates: Custom templates instead of the split's, with ``{n}`` (numeral) and/or ``{word}`` (English word)
            placeholders, e.g. ``"a tiny {word}"``.
        digits: Only these digits (default all ten), e.g. ``[7]`` for a single-class run.
    """

    name: ClassVar[str] = "digit-prompts"

    def __init__(
        self,
        split: PromptSplit | str = "pretrain",
        templates: list[str] | None = None,
        digits: list[int] | None = None,
    ) -> None:
        self.split = split
        self.templates = templates
        self.digits = digits

    def _templates(self) -> tuple[str, ...]:
        if self.templates is not None:
            return tuple(self.templates)
        return PROMPT_SPLITS[self.split]

    def validate(self, recipe: Any) -> list[str]:
        """Check the split, the digits and that each template names the digit."""
        problems: list[str] = []
        if self.templates is None and self.split not in PROMPT_SPLITS:
            hint = _RENAMED.get(self.split, f"must be one of {sorted(PROMPT_SPLITS)}")
            problems.append(f"prompts.init_args.split: {hint}, got {self.split!r}")
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
