"""The base of every registrable component: its ``name``, ``kind``, argument checks, ``validate`` and state.

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar, TypeVar

from rlpost.core.api.arguments import InvalidArguments, constructor_problems
from rlpost.core.api.hub import HubFiles

__all__ = ["Component"]

_C = TypeVar("_C", bound="Component")


class Component(ABC):  # noqa: B024 - a marker base: subclasses define the abstract methods of their kind
    """Base of every registrable component. ``name`` is the kebab-case short name used in recipes.

    Constructor arguments that declare a :class:`~rlpost.core.api.arguments.Range` in their annotation
    (``k: Annotated[int, Range(ge=2)] = 3``) are checked before ``__init__`` runs: a refused value raises
    :class:`~rlpost.core.api.arguments.InvalidArguments` naming every refused argument, which recipe validation
    reports under the argument's field. So no component exists with an argument outside its declared range, and no
    other component's ``validate`` ever meets one.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""

    def __new__(cls: type[_C], *args: Any, **kwargs: Any) -> _C:
        # __new__ sees the constructor's arguments before __init__ does; jsonargparse still reads the signature of
        # __init__ (a __new__ inherited from a base class does not hide it).
        problems = constructor_problems(cls, args, kwargs)
        if problems:
            raise InvalidArguments(cls.__name__, problems)
        return super().__new__(cls)

    def validate(self, recipe: Any) -> list[str]:
        """Return human-readable problems with this component in the context of the whole recipe.

        Called by ``rlpost validate`` and before training, before any model is loaded. The default finds none.
        Arguments outside their declared ranges never get here (the constructor refused them). The components that
        may consult the sampler (``recipe.counts()``: the advantage estimator and the policy optimizer) are validated
        only once the sampler's own ``validate`` found nothing.

        Args:
            recipe: The resolved :class:`rlpost.engine.recipe.Recipe` (with instantiated components).
        """
        return []

    def hub_files(self) -> list[HubFiles]:
        """The Hugging Face Hub files this component needs with its current arguments (a base model, a reward
        checkpoint, a prompt dataset), which ``rlpost download --recipe R`` fetches into the Hugging Face cache.

        Called on a constructed component, before any weight loads; it must not touch the network. Files the recipe
        points at by a local path, or that ship with the component, are not declared. The default needs nothing.
        """
        return []

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (JSON-serialisable values or tensors). Default: stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional, stateless by default
        """Restore what :meth:`state_dict` returned."""
