"""Component names: registered short names and class names resolved to dotted class paths, and contested names
(claimed by two distributions) refused unless the recipe replaces them.

jsonargparse resolves a ``class_path`` only from an import path or a subclass's class name
(https://jsonargparse.readthedocs.io/en/stable/#class-type-and-subclasses), not from a plugin registry, so every
name is resolved here first: in recipe documents (:func:`resolve_names`, used by the parser's loader), in
command-line options (:func:`resolve_argv_names`) and for validation (:func:`resolve_component`, which records a
problem with the nearest name for an unknown one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import yaml

from rlpost.core.registry import ContestedComponentError, Registries, suggest
from rlpost.core.yaml_limits import load_yaml, short_repr
from rlpost.engine.recipe.schema import EVAL_SECTIONS, SECTIONS, RecipeError, Section

__all__ = [
    "NAMED_HELP_OPTIONS",
    "NAMED_OPTIONS",
    "contested_sections",
    "refuse_contested",
    "resolve_argv_names",
    "resolve_component",
    "resolve_names",
]


def resolve_component(value: Any, field_name: str, kind: str, host: Registries, problems: list[str]) -> Any:
    """Translate a registered short name into a dotted class_path; flatten ``{class_path, k: v}`` shorthand."""
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, dict):
        problems.append(
            f"{field_name}: expected a component ({{class_path: ..., init_args: ...}}), got {short_repr(value)}"
        )
        return None
    value = dict(value)
    extra = {k: value.pop(k) for k in list(value) if k not in ("class_path", "init_args", "dict_kwargs")}
    if extra:
        value["init_args"] = {**value.get("init_args", {}), **extra}
    class_path = value.get("class_path")
    if not isinstance(class_path, str):
        problems.append(f"{field_name}.class_path: missing; choose one of {host.registry(kind).names()}")
        return None
    registry = host.registry(kind)
    try:
        entry = registry.get(class_path)
    except ContestedComponentError as exc:  # two distributions claim the name: never pick one silently
        problems.append(f"{field_name}.class_path: {exc}")
        return None
    except KeyError as exc:
        if ":" in class_path:  # a qualified dist:name that does not exist
            problems.append(f"{field_name}.class_path: {exc.args[0]}")
            return None
        entry = None
    if entry is not None:
        value["class_path"] = entry.class_path
    elif "." not in class_path:
        by_class = [e for e in registry.entries() if e.cls.__name__ == class_path]
        if by_class:
            value["class_path"] = by_class[0].class_path
        else:
            problems.append(
                f"{field_name}.class_path: unknown {kind} {short_repr(class_path)}"
                f"{suggest(class_path, registry.names())} "
                f"(available: {', '.join(registry.names()) or 'none'})"
            )
            return None
    return value


def contested_sections(doc: dict[str, Any], host: Registries) -> dict[str, list[str]]:
    """Top-level section -> problems, for every component in ``doc`` named by a contested short name."""
    found: dict[str, list[str]] = {}

    def check(value: Any, kind: str, field: str, top: str) -> None:
        name = value if isinstance(value, str) else value.get("class_path") if isinstance(value, dict) else None
        if not isinstance(name, str):
            return
        try:
            host.registry(kind).get(name)
        except ContestedComponentError as exc:
            found.setdefault(top, []).append(f"{field}.class_path: {exc}")
        except KeyError:
            pass  # unknown names: validate() reports them with the nearest name

    def walk(data: dict[str, Any], sections: tuple[Section, ...], prefix: str, top: str | None) -> None:
        for s in sections:
            value, field = data.get(s.name), prefix + s.name
            if s.kind == "component" and s.name in data:
                check(value, s.registry, field, top or s.name)
            elif s.kind == "component-list" and isinstance(value, list):
                for i, item in enumerate(value):
                    check(item, s.registry, f"{field}[{i}]", top or s.name)
            elif s.kind == "component-mapping" and isinstance(value, dict):
                for key, item in value.items():
                    check(item, s.registry, f"{field}.{key}", top or s.name)
            elif s.kind == "eval" and isinstance(value, dict):
                walk(value, EVAL_SECTIONS, f"{field}.", top or s.name)

    walk(doc, SECTIONS, "", None)
    return found


def refuse_contested(argv: Sequence[str], docs: list[dict[str, Any]], host: Registries) -> None:
    """Refuse a contested component name in a recipe file unless a later file or a later command-line option sets
    its top-level section (the file's choice is then never used, as with any overridden value).

    Raises:
        RecipeError: Naming every claimant and how to choose (a qualified ``distribution:name``, a class path, or
            blocking a plugin).
    """
    positions = [i for i, token in enumerate(argv) if token == "--recipe" or token.startswith("--recipe=")]
    problems: list[str] = []
    for n, (at, doc) in enumerate(zip(positions, docs, strict=False)):
        for section, found in contested_sections(doc, host).items():
            later_file = any(section in other for other in docs[n + 1 :])
            later_option = any(
                token.split("=")[0] == f"--{section}" or token.startswith(f"--{section}.") for token in argv[at + 1 :]
            )
            if not (later_file or later_option):
                problems += found
    if problems:
        raise RecipeError(problems)


def resolve_names(doc: dict[str, Any], host: Registries, contested_to_registered: bool = False) -> dict[str, Any]:
    """``doc`` with the components it names by registered short name or class name given by dotted class path (and
    ``{class_path: x, k: v}`` shorthand moved into ``init_args``). Unknown names are left for
    :func:`~rlpost.engine.recipe.validate.validate` to report with its nearest-name suggestion.

    With ``contested_to_registered``, a contested name becomes the class the registry kept (first-party wins), so
    jsonargparse can load a recipe file whose contested section a later file or option replaces;
    :func:`~rlpost.engine.recipe.parse.parse_recipe_args` has already refused every contested name that nothing replaces
    (:func:`contested_sections`)."""

    def one(value: Any, kind: str) -> Any:
        resolved = resolve_component(value, "", kind, host, [])
        if resolved is None and contested_to_registered:
            name = value if isinstance(value, str) else value.get("class_path") if isinstance(value, dict) else None
            kept = [e for e in host.registry(kind).entries() if e.name == name]
            if kept and host.registry(kind).claims(str(name))[1:]:
                spec = {"class_path": value} if isinstance(value, str) else dict(value)
                resolved = resolve_component({**spec, "class_path": kept[0].class_path}, "", kind, host, [])
        return value if resolved is None else resolved

    def section(data: dict[str, Any], sections: tuple[Section, ...]) -> dict[str, Any]:
        out = dict(data)
        for s in sections:
            value = out.get(s.name)
            if s.kind == "component" and s.name in out:
                out[s.name] = one(value, s.registry)
            elif s.kind == "component-list" and isinstance(value, list):
                out[s.name] = [one(item, s.registry) for item in value]
            elif s.kind == "component-mapping" and isinstance(value, dict):
                out[s.name] = {name: one(item, s.registry) for name, item in value.items()}
            elif s.kind == "eval" and isinstance(value, dict):
                out[s.name] = section(value, EVAL_SECTIONS)
        return out

    return section(doc, SECTIONS)


# Command-line options that take a component name, and the registry that resolves it.
NAMED_OPTIONS: dict[str, str] = {
    **{s.name: s.registry for s in SECTIONS if s.kind == "component"},
    **{f"eval.{e.name}": e.registry for e in EVAL_SECTIONS if e.kind == "component"},
}
# List and mapping fields whose ``--KEY.help NAME`` names one component (``--KEY NAME`` gives the whole list).
NAMED_HELP_OPTIONS: dict[str, str] = {
    **NAMED_OPTIONS,
    **{s.name: s.registry for s in SECTIONS if s.kind == "component-list"},
    **{f"eval.{e.name}": e.registry for e in EVAL_SECTIONS if e.kind != "component"},
}


def resolve_argv_names(argv: Sequence[str], host: Registries) -> list[str]:
    """``argv`` with the component named by ``--KEY NAME``, ``--KEY.class_path NAME`` or ``--KEY.help NAME`` given by
    dotted class path (see :mod:`rlpost.engine.recipe.names` for why jsonargparse needs that). Only these options are
    touched; every other token is left to jsonargparse.

    Raises:
        RecipeError: If NAME is not a registered name, class name or dotted class path (with the nearest name).
    """
    out = list(argv)
    for i, token in enumerate(out):
        option, eq, value = token.partition("=")
        key = option[2:].removesuffix(".class_path").removesuffix(".help") if option.startswith("--") else ""
        kinds = NAMED_HELP_OPTIONS if option.endswith(".help") else NAMED_OPTIONS
        inline = option == f"--{key}" and key in NAMED_HELP_OPTIONS  # may be given as a YAML mapping or list
        if key not in kinds and not inline:
            continue
        at = i if eq else i + 1
        if not eq:
            if at >= len(out):
                continue  # jsonargparse reports the missing value
            value = out[at]
        if inline and value.lstrip().startswith(("{", "[")):
            resolved_value = _resolve_inline(key, value, host)
            out[at] = f"{option}={resolved_value}" if eq else resolved_value
            continue
        if key not in kinds or value.startswith("-"):
            continue  # the next option: jsonargparse reports the missing value
        if "." in value and not _registered(host, kinds[key], value):
            continue  # a class path (a registered name may hold a dot: hps-v2.1): jsonargparse reads it
        problems: list[str] = []
        resolved = resolve_component(
            value, key + (".help" if option.endswith(".help") else ""), kinds[key], host, problems
        )
        if resolved is None:
            raise RecipeError([p.replace(".help.class_path:", ".help:") for p in problems])
        out[at] = f"{option}={resolved['class_path']}" if eq else resolved["class_path"]
    return out


def _registered(host: Registries, kind: str, name: str) -> bool:
    """Whether ``name`` is a registered (or contested) name of ``kind``, or a qualified ``distribution:name`` (which
    :func:`resolve_component` reports when unknown): no class path."""
    return name in host.registry(kind) or ":" in name


def _resolve_inline(key: str, value: str, host: Registries) -> str:
    """A YAML mapping or list given for the component field ``key`` (``--rewards '[jpeg-compressibility]'``), with
    its registered names resolved as in a recipe file (:func:`resolve_names`), as JSON for jsonargparse; ``value``
    itself when it is no YAML (jsonargparse reports that)."""
    try:
        loaded = load_yaml(value, f"--{key}")
    except yaml.YAMLError:
        return value
    doc: dict[str, Any] = {}
    node = doc
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = loaded
    contested = contested_sections(doc, host)
    if contested:
        raise RecipeError([problem for found in contested.values() for problem in found])
    node = resolve_names(doc, host)
    for part in parents:
        node = node[part]
    return json.dumps(node[leaf])
