"""Typed component registries filled by the ``rlpost_register_*`` hooks.

A :class:`Registry` holds component *classes* of one kind, keyed by their self-declared kebab-case ``name``.
It records which plugin and distribution registered each class (for ``rlpost plugins list`` and run manifests)
and refuses a second class under a name already taken, naming both distributions.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Generic, TypeVar

from rlpost.api import Component

__all__ = ["DuplicateComponentError", "Registry", "RegistryEntry", "suggest"]

C = TypeVar("C", bound=Component)

_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")


class DuplicateComponentError(ValueError):
    """Two plugins registered a component of the same kind under the same name."""


@dataclass(frozen=True)
class RegistryEntry(Generic[C]):
    """One registered component class and where it came from.

    Attributes:
        name: The component's kebab-case name.
        cls: The component class.
        plugin: Name of the plugin that registered it.
        distribution: Distribution (``pip`` package) providing the plugin, or ``"rlpost"`` for built-ins.
    """

    name: str
    cls: type[C]
    plugin: str
    distribution: str

    @property
    def class_path(self) -> str:
        """Dotted import path of the class (what jsonargparse's ``class_path`` expects)."""
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


def suggest(name: str, choices: list[str]) -> str:
    """A "did you mean" suffix for an unknown ``name`` among ``choices`` (empty when nothing is close)."""
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


class Registry(Generic[C]):
    """Registry of one component kind. Plugins receive it in a registration hook and call it with a class.

    Args:
        kind: Human-readable kind ("sampler", "reward", ...).
        base: The ABC every registered class must subclass.
    """

    def __init__(self, kind: str, base: type[C]) -> None:
        self.kind = kind
        self.base = base
        self._entries: dict[str, RegistryEntry[C]] = {}
        self._current: tuple[str, str] = ("<unknown>", "<unknown>")

    def set_provenance(self, plugin: str, distribution: str) -> None:
        """Set the plugin/distribution credited for the next registrations (called by the plugin host)."""
        self._current = (plugin, distribution)

    def __call__(self, cls: type[C]) -> type[C]:
        """Register ``cls`` under ``cls.name``.

        Raises:
            TypeError: If ``cls`` is not a subclass of this registry's base or has no valid name.
            DuplicateComponentError: If another plugin already registered a class under that name.
        """
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{self.kind} registry accepts subclasses of {self.base.__name__}, got {cls!r}")
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not _NAME.match(name):
            raise TypeError(
                f"{cls.__qualname__} must declare a kebab-case class attribute 'name' "
                f"(e.g. name = 'tree'), got {name!r}"
            )
        plugin, dist = self._current
        existing = self._entries.get(name)
        if existing is not None:
            if existing.cls is cls:
                return cls
            raise DuplicateComponentError(
                f"{self.kind} name {name!r} is registered twice: by {existing.class_path} "
                f"(plugin {existing.plugin!r}, distribution {existing.distribution!r}) and by "
                f"{cls.__module__}.{cls.__qualname__} (plugin {plugin!r}, distribution {dist!r})"
            )
        self._entries[name] = RegistryEntry(name=name, cls=cls, plugin=plugin, distribution=dist)
        return cls

    def get(self, name: str) -> RegistryEntry[C]:
        """Return the entry for ``name``.

        Raises:
            KeyError: With a "did you mean" message when ``name`` is unknown.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}{suggest(name, self.names())}") from None

    def find_class(self, cls: type) -> RegistryEntry[C] | None:
        """Return the entry whose class is ``cls``, if registered."""
        for entry in self._entries.values():
            if entry.cls is cls:
                return entry
        return None

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self._entries)

    def entries(self) -> list[RegistryEntry[C]]:
        """All entries, sorted by name."""
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
