"""The base of every registrable component: its ``name``, ``kind``, ``validate`` and state.

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

__all__ = ["Component"]


class Component(ABC):  # noqa: B024 - a marker base: subclasses define the abstract methods of their kind
    """Base of every registrable component. ``name`` is the kebab-case short name used in recipes."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""

    def validate(self, recipe: Any) -> list[str]:
        """Return human-readable problems with this component in the context of the whole recipe.

        Called by ``rlpost validate`` and before training, before any model is loaded. The default finds none.

        Args:
            recipe: The resolved :class:`rlpost.engine.recipe.Recipe` (with instantiated components).
        """
        return []

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (JSON-serialisable values or tensors). Default: stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional, stateless by default
        """Restore what :meth:`state_dict` returned."""
