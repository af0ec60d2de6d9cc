"""What rlpost ships beside its code (the digits world's models in ``assets/``, the recipes in ``recipes/``) and the
rule by which a relative path in a recipe finds a file (``docs/recipes.md``, "Paths in a recipe").

A wheel carries ``assets/`` as ``rlpost/_assets`` and ``recipes/`` as ``rlpost/_recipes`` (``pyproject.toml``, hatch
``force-include``); a source checkout or editable install, where neither exists, reads the checkout's own folders.

The rule, for a relative path ``P`` (a string with a ``/`` or a file suffix: ``assets/digits-sd3``,
``prompts.txt``; a bare word such as ``eval`` is never a path) written in a recipe file ``F`` (or given on the command
line, where ``F``'s directory is the current directory):

1. ``F``'s directory / ``P``, when it exists;
2. else, when ``P`` starts with ``assets/`` or ``recipes/``, the shipped copy, when it exists;
3. else ``P`` unchanged (relative to the current directory, as any program reads it).

So the shipped recipes (which name ``assets/digits-sd3`` and ``recipes/bench/digits/base.yaml``) and copies of them
made with ``rlpost recipes copy`` run from any directory and from an installed wheel.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

__all__ = ["SHIPPED_PREFIXES", "resolve_relative", "shipped_asset", "shipped_root"]

SHIPPED_PREFIXES = ("assets", "recipes")
"""The first path components that name a shipped folder."""

_PACKAGED = {"assets": "_assets", "recipes": "_recipes"}


def shipped_root(kind: str) -> Path | None:
    """The shipped folder ``kind`` (``assets`` or ``recipes``): ``rlpost/_<kind>`` in an installed wheel, else the
    source checkout's ``<kind>/``; ``None`` when neither exists (a wheel built without it)."""
    if kind not in _PACKAGED:
        raise ValueError(f"unknown shipped folder {kind!r}; expected one of {list(_PACKAGED)}")
    packaged = Path(str(importlib.resources.files("rlpost").joinpath(_PACKAGED[kind])))
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / kind
    return checkout if checkout.is_dir() else None


def shipped_asset(name: str) -> Path:
    """Where the shipped asset ``name`` (``digits-sd3``) is: ``assets/<name>`` of the installed package (wheel) or of
    the source checkout. The path is returned whether or not it exists (a wheel built without ``assets/`` gives
    ``assets/<name>`` relative to the current directory), so the loader that opens it names what is missing."""
    root = shipped_root("assets")
    return (root if root is not None else Path("assets")) / name


def resolve_relative(value: str, base: Path | None = None) -> str:
    """``value`` after the rule of this module: an absolute path when a relative path finds a file next to its recipe
    (``base``: the recipe file's directory; ``None``: the current directory) or among the shipped ones; else
    ``value`` unchanged (an absolute path, a Hub id, a name, or a path that does not exist yet)."""
    if not value or "\n" in value or "://" in value or value.startswith(("~", "/")) or Path(value).is_absolute():
        return value
    if "/" not in value and "\\" not in value and not Path(value).suffix:
        return value  # a bare word (a split, a kernel, a device): never a path
    here = (base or Path.cwd()) / value
    if base is not None and here.exists():
        return str(here.resolve())
    head, _, rest = value.replace("\\", "/").removeprefix("./").partition("/")
    if base is None and here.exists():
        return value  # the command line's own relative path: left to the current directory
    if head in SHIPPED_PREFIXES and rest:
        root = shipped_root(head)
        if root is not None and (root / rest).exists():
            return str((root / rest).resolve())
    return value
