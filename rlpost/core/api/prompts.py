"""The prompt-source contract: a finite list of prompts with metadata.

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

from rlpost.core.api.component import Component

__all__ = ["PromptSource"]


class PromptSource(Component):
    """A finite list of prompts with metadata, shuffled deterministically per epoch by the core."""

    kind: ClassVar[str] = "prompts"

    @abstractmethod
    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """Return all ``(prompt, metadata)`` pairs. Called once."""
