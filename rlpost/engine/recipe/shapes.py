"""The shape each recipe section's value must have (a mapping of settings, a component, a list of components, ...),
checked before jsonargparse reads it.

jsonargparse takes a scalar given for a settings group in a recipe file for the name of a settings file, and
silently drops one given for a group of separate options (``run: 5`` in an overlay left the run section as it was, and
``eval: 5`` turned evaluation off); given to a dataclass it fails inside its instantiation with a message about
``functools.partial``. :func:`shape_problems` names the section and what it must hold instead, and is applied to every
recipe file (:mod:`~rlpost.engine.recipe.parse`) and to the merged recipe (:mod:`~rlpost.engine.recipe.validate`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Union

from rlpost.core.yaml_limits import short_repr
from rlpost.engine.recipe.schema import SECTION, Section

__all__ = ["section_shape_problems", "shape_problems"]

_EXPECTED = {
    "component": "a component: a registered name or {class_path: NAME, init_args: {...}}",
    "component-list": "a list of components (each a registered name or {class_path: NAME, init_args: {...}})",
    "factory": "a class path (e.g. torch.optim.AdamW) or {class_path: ..., init_args: {...}}",
    "mapping": "a mapping of reward name to number",
    "eval": "a mapping (prompts or sets, rewards, judges, num_steps, every, seed, batch_size, ...)",
}


def shape_problems(doc: Mapping[str, Any]) -> list[str]:
    """The shape problem of each known section in ``doc`` (a recipe file or the merged recipe), each naming the
    section (``run: expected a mapping of its settings (seed, output_dir, ...), got 5``). Unknown keys are left to
    validation, which names them with the nearest section."""
    return [p for name, value in doc.items() if name in SECTION for p in section_shape_problems(SECTION[name], value)]


def section_shape_problems(s: Section, value: Any) -> list[str]:
    """Why ``value`` cannot be the section ``s`` (empty when its shape is right; its contents are validation's).
    ``null`` is always a shape: an optional section off, or a section's defaults."""
    if value is None:
        return []
    if s.kind == "config":
        return _settings_problems(s.name, s.type, value)
    if s.kind == "config-mapping":
        if not isinstance(value, dict):
            return [f"{s.name}: expected a mapping of name to settings, got {short_repr(value)}"]
        return [p for k, v in value.items() for p in _settings_problems(f"{s.name}.{k}", s.type, v)]
    if s.kind == "component":
        return _component_problems(s.name, value)
    if s.kind == "component-list":
        if not isinstance(value, list):
            return [f"{s.name}: expected {_EXPECTED[s.kind]}, got {short_repr(value)}"]
        return [p for i, item in enumerate(value) for p in _component_problems(f"{s.name}[{i}]", item)]
    if s.kind == "factory":
        ok = isinstance(value, str) or (isinstance(value, dict) and not _bad_init_args(value))
        return [] if ok else [f"{s.name}: expected {_EXPECTED[s.kind]}, got {short_repr(value)}"]
    ok = isinstance(value, dict)  # mapping, eval
    return [] if ok else [f"{s.name}: expected {_EXPECTED[s.kind]}, got {short_repr(value)}"]


def _component_problems(where: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return []
    if not isinstance(value, dict):
        return [f"{where}: expected {_EXPECTED['component']}, got {short_repr(value)}"]
    if _bad_init_args(value):
        return [f"{where}.init_args: expected a mapping of constructor arguments, got {short_repr(value['init_args'])}"]
    return []


def _bad_init_args(value: dict[Any, Any]) -> bool:
    return value.get("init_args") is not None and not isinstance(value.get("init_args"), dict)


def _settings_problems(where: str, settings: type, value: Any) -> list[str]:
    """A settings section (a dataclass) must be a mapping, and so must each of its fields that is itself settings
    (``run.speedups``)."""
    fields = dataclasses.fields(settings)
    if not isinstance(value, dict):
        names = ", ".join(f.name for f in fields[:4]) + (", ..." if len(fields) > 4 else "")
        return [f"{where}: expected a mapping of its settings ({names}), got {short_repr(value)}"]
    try:
        hints = typing.get_type_hints(settings)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved here: its fields' shapes go unchecked
        hints = {}
    problems: list[str] = []
    for f in fields:
        nested = _settings_type(hints.get(f.name))
        if nested is not None and f.name in value and value[f.name] is not None:
            problems += _settings_problems(f"{where}.{f.name}", nested, value[f.name])
    return problems


def _settings_type(annotation: Any) -> type | None:
    """The dataclass ``annotation`` names (alone or with ``None``), or ``None``."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        found = [t for t in typing.get_args(annotation) if t is not type(None)]
        annotation = found[0] if len(found) == 1 else None
    return annotation if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) else None
