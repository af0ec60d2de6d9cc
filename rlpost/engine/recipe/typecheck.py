"""Type checks by jsonargparse, one value at a time, with problems that name the recipe field and the nearest option.

jsonargparse names neither the field path nor a close name when it rejects a value; :func:`check_with_parser` and
:func:`unknown_option_problem` add both. :func:`with_defaults` fills a component's constructor defaults in, so the
saved ``recipe.yaml`` shows every setting a run used.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
from typing import Any

from jsonargparse import ArgumentParser

from rlpost.core.api import InvalidArguments

__all__ = ["check_with_parser", "clean_message", "init_signature", "unknown_option_problem", "with_defaults"]


def check_with_parser(key: str, typ: Any, value: Any, problems: list[str], where: str | None = None) -> Any:
    """Type-check one section with jsonargparse and instantiate it; on failure record the message prefixed with the
    field name (``where``, default ``key``). An unknown option is reported under its full field path with the nearest
    name, and each argument a component's constructor refused (:class:`~rlpost.core.api.InvalidArguments`) under
    ``where.init_args.NAME``."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument(f"--{key}", type=typ)
    where = where or key
    try:
        ns = parser.parse_object({key: value})
        return parser.instantiate_classes(ns)[key]
    except InvalidArguments as exc:  # the constructor's own checks, argument by argument
        problems.extend(f"{where}.init_args.{name}: {text}" for name, text in exc.problems.items())
        return None
    except Exception as exc:  # noqa: BLE001 - jsonargparse raises several types; all are recipe problems
        problems.append(
            unknown_option_problem(where, typ, value, str(exc)) or f"{where}: {clean_message(str(exc), key)}"
        )
        return None


_UNKNOWN_OPTION = re.compile(r"Option '([^']+)' is not accepted|does not accept option '([^']+)'")


def unknown_option_problem(where: str, typ: Any, value: Any, message: str) -> str | None:
    """``where.init_args.NAME: unknown option; did you mean where.init_args.CLOSE?`` for jsonargparse's "option not
    accepted" errors (``None`` for any other error): jsonargparse names neither the field path nor a close name."""
    match = _UNKNOWN_OPTION.search(message)
    if match is None:
        return None
    name = match.group(1) or match.group(2)
    if isinstance(value, list) and len(value) == 1:  # a list section (rewards) is checked one item at a time
        value = value[0]
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        prefix = f"{where}.init_args."
        choices = _init_parameters(value["class_path"])
    elif dataclasses.is_dataclass(typ):
        prefix = f"{where}."
        choices = [f.name for f in dataclasses.fields(typ)]
    else:
        return None
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    if close:
        hint = "; did you mean " + " or ".join(prefix + c for c in close) + "?"
    else:
        hint = f" (options: {', '.join(choices) or 'none'})"
    return f"{prefix}{name}: unknown option{hint}"


def init_signature(class_path: str) -> list[inspect.Parameter]:
    """Constructor parameters of ``class_path``, following ``**kwargs`` up the MRO as jsonargparse does (empty when
    the class cannot be imported)."""
    module_name, _, attr = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return []
    found: list[inspect.Parameter] = []
    for klass in inspect.getmro(cls) if inspect.isclass(cls) else ():
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        seen = {p.name for p in found}
        found += [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in seen]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return found


def _init_parameters(class_path: str) -> list[str]:
    """Constructor parameter names of ``class_path`` (see :func:`init_signature`)."""
    return [p.name for p in init_signature(class_path)]


_NO_DEFAULT = object()


def _plain_default(value: Any) -> Any:
    """``value`` as plain YAML data (dataclasses as mappings, tuples as lists), or ``_NO_DEFAULT`` when it has no
    faithful plain form (a callable, a dtype, ...): such a default is left to the class."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain_default(dataclasses.asdict(value))
    if isinstance(value, (list, tuple)):
        items = [_plain_default(v) for v in value]
        return _NO_DEFAULT if any(v is _NO_DEFAULT for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        plain = {k: _plain_default(v) for k, v in value.items()}
        return _NO_DEFAULT if any(v is _NO_DEFAULT for v in plain.values()) else plain
    return _NO_DEFAULT


def with_defaults(value: Any) -> Any:
    """A resolved component (``{class_path, init_args}``) with every constructor default the recipe leaves out filled
    into ``init_args``, so ``--print_config`` and the saved ``recipe.yaml`` show every setting a run used."""
    if not (isinstance(value, dict) and isinstance(value.get("class_path"), str)):
        return value
    init = dict(value.get("init_args") or {})
    for param in init_signature(value["class_path"]):
        if param.name in init or param.default is inspect.Parameter.empty:
            continue
        default = _plain_default(param.default)
        if default is not _NO_DEFAULT:
            init[param.name] = default
    return {**value, "init_args": init} if init else value


_NOT_A_MAPPING = re.compile(r"functools\.partial\(.*\) argument after \*\* must be a mapping, not (\w+)")


def clean_message(message: str, key: str) -> str:
    """jsonargparse's message on one line, without its parser-key prefix; settings (a dataclass) given something
    other than a mapping say so instead of naming jsonargparse's instantiation internals."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    text = " ".join(lines)
    not_a_mapping = _NOT_A_MAPPING.search(text)
    if not_a_mapping is not None:
        return f"expected a mapping of its settings, got a value of type {not_a_mapping.group(1)}"
    return text.replace(f'Parser key "{key}":', "").strip()
