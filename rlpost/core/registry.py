"""Typed component registries filled by the ``rlpost_register_*`` hooks.

A :class:`Registry` holds component *classes* of one kind, keyed by their self-declared kebab-case ``name``.
It records which plugin and distribution registered each class (for ``rlpost plugins list`` and run manifests)
and refuses a second class under a name already taken, naming both distributions.

The plugin host registers first-party plugins (distribution ``rlpost``) before any third-party one, so a built-in
always keeps its name. The refused claim is remembered: the name is then *contested*, and :meth:`Registry.get`
refuses an unqualified lookup of it (naming every claimant) so a recipe never silently gets a component its author
did not mean. ``dist:name`` (e.g. ``rlpost:jpeg-compressibility``) chooses explicitly.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from rlpost.core.api import Component

__all__ = [
    "ContestedComponentError",
    "DuplicateComponentError",
    "Registries",
    "Registry",
    "RegistryEntry",
    "suggest",
]

C = TypeVar("C", bound=Component)

_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")


class DuplicateComponentError(ValueError):
    """Two plugins registered a component of the same kind under the same name."""


class ContestedComponentError(LookupError):
    """A component name claimed by more than one distribution was looked up without saying which one is meant."""


@dataclass(frozen=True)
class Claim:
    """One attempt to register a class under a name (kept even when refused, so the contest stays visible).

    Attributes:
        plugin: Plugin that made the claim.
        distribution: Its distribution.
        class_path: Dotted path of the claimed class.
    """

    plugin: str
    distribution: str
    class_path: str


def canonical_distribution(name: str) -> str:
    """PEP 503 normalised distribution name (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


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
        # Every distinct class ever offered under a name, winner first; more than one claim = contested name.
        self._claims: dict[str, list[Claim]] = {}
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
        class_path = f"{cls.__module__}.{cls.__qualname__}"
        existing = self._entries.get(name)
        if existing is not None and existing.cls is cls:
            return cls
        claims = self._claims.setdefault(name, [])
        if not any(c.class_path == class_path and c.distribution == dist for c in claims):
            claims.append(Claim(plugin=plugin, distribution=dist, class_path=class_path))
        if existing is not None:
            raise DuplicateComponentError(
                f"{self.kind} name {name!r} is registered twice: by {existing.class_path} "
                f"(plugin {existing.plugin!r}, distribution {existing.distribution!r}) and by "
                f"{class_path} (plugin {plugin!r}, distribution {dist!r}); the second registration is refused"
                + (" (built-in names always stay with rlpost)" if existing.distribution == "rlpost" else "")
            )
        self._entries[name] = RegistryEntry(name=name, cls=cls, plugin=plugin, distribution=dist)
        return cls

    def remove_plugin(self, plugin: str) -> list[str]:
        """Drop every component ``plugin`` registered (the host calls this when the plugin fails to register).

        Its claims are kept, so a name it tried to take stays contested.

        Returns:
            The removed names.
        """
        gone = [name for name, entry in self._entries.items() if entry.plugin == plugin]
        for name in gone:
            del self._entries[name]
        return sorted(gone)

    def claims(self, name: str) -> list[Claim]:
        """Every distinct class offered under ``name`` (the registered one first); empty when unknown."""
        return list(self._claims.get(name, []))

    def contested(self) -> dict[str, list[Claim]]:
        """Names claimed by more than one class, with their claims."""
        return {name: list(claims) for name, claims in sorted(self._claims.items()) if len(claims) > 1}

    def get(self, name: str) -> RegistryEntry[C]:
        """Return the entry for ``name`` or for a qualified ``distribution:name``.

        Raises:
            KeyError: With a "did you mean" message when ``name`` is unknown.
            ContestedComponentError: When more than one distribution claimed an unqualified ``name``, or the
                qualified claim was refused; the message names every claimant and how to choose.
        """
        dist, sep, short = name.rpartition(":")
        if not sep:
            short = name
        entry = self._entries.get(short)
        claims = self._claims.get(short, [])
        if sep:
            wanted = canonical_distribution(dist)
            mine = [c for c in claims if canonical_distribution(c.distribution) == wanted]
            if entry is not None and canonical_distribution(entry.distribution) == wanted:
                return entry
            if mine:
                raise ContestedComponentError(self._contest_message(short, refused=mine[0]))
            if entry is None:
                raise KeyError(f"unknown {self.kind} {name!r}{suggest(short, self.names())}")
            raise KeyError(
                f"{self.kind} {short!r} does not come from distribution {dist!r} "
                f"(it is registered by {entry.distribution!r}: write {entry.distribution}:{short})"
            )
        if entry is None:
            if claims:  # every claimant failed to register: say so rather than "unknown"
                raise ContestedComponentError(self._contest_message(short, refused=claims[0]))
            raise KeyError(f"unknown {self.kind} {name!r}{suggest(name, self.names())}")
        if len(claims) > 1:
            raise ContestedComponentError(self._contest_message(short))
        return entry

    def _contest_message(self, name: str, refused: Claim | None = None) -> str:
        entry = self._entries.get(name)
        claims = self._claims.get(name, [])
        who = " and ".join(f"distribution {c.distribution!r} (plugin {c.plugin!r}, {c.class_path})" for c in claims)
        if refused is not None:
            how = f"to use it anyway, write its class path '{refused.class_path}'"
            if entry is not None:
                how += f" or block plugin {entry.plugin!r} with RLPOST_BLOCK_PLUGINS={entry.plugin}"
            return (
                f"{self.kind} {name!r} of distribution {refused.distribution!r} was refused (claimed by {who}); {how}"
            )
        others = [c for c in claims if entry is None or c.class_path != entry.class_path]
        choices = [f"'{entry.distribution}:{name}' for the registered one"] if entry is not None else []
        choices += [f"the class path '{c.class_path}' for the one from {c.distribution!r}" for c in others]
        block = ",".join(sorted({c.distribution for c in others}))
        how = f"say which one you mean: write {' or '.join(choices)}"
        if entry is not None:
            how += f", or block the other plugin with RLPOST_BLOCK_PLUGINS={block}"
        return f"{self.kind} name {name!r} is contested (claimed by {who}); {how}"

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
        """True when ``name`` (or qualified ``distribution:name``) names a registered class; contested names count."""
        if not isinstance(name, str):
            return False
        dist, sep, short = name.rpartition(":")
        if not sep:
            return name in self._entries
        entry = self._entries.get(short)
        return entry is not None and canonical_distribution(entry.distribution) == canonical_distribution(dist)

    def __len__(self) -> int:
        return len(self._entries)


class Registries(Protocol):
    """One :class:`Registry` per component kind, looked up by key (``sampler``, ``advantage``, ``reward``,
    ``optimizer``, ``model``, ``prompts``). What recipe validation needs to resolve names; the plugin host is one."""

    def registry(self, key: str) -> Registry[Any]:
        """The registry of ``key``."""
        ...
