"""The problems of a component built from keyword arguments, as a recipe reports them (for the components' tests).

An argument outside its declared range is refused by the constructor (``rlpost.InvalidArguments``); recipe validation
reports each under ``SECTION.init_args.NAME`` (``rlpost/engine/recipe/typecheck.py``), and the component's own
``validate`` reports the rest. :func:`problems_of` gives both in that form, so a test need not know which one refuses.
"""

from __future__ import annotations

from typing import Any

from rlpost import InvalidArguments


def problems_of(cls: type, section: str, recipe: Any = None, **kwargs: Any) -> list[str]:
    """``cls(**kwargs)``'s refused arguments as ``SECTION.init_args.NAME: ...`` lines, or, when the constructor
    accepts them, the instance's ``validate(recipe)``."""
    try:
        component = cls(**kwargs)
    except InvalidArguments as exc:
        return [f"{section}.init_args.{name}: {text}" for name, text in exc.problems.items()]
    return list(component.validate(recipe))
