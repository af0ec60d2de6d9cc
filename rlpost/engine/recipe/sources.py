"""Recipe files as plain data: read with the YAML limits of :mod:`rlpost.core.yaml_limits` and merged in order.

jsonargparse merges the ``--recipe`` files and ``--a.b value`` options of a command line itself
(:func:`rlpost.engine.recipe.parse.parse_recipe_args`); the plain merge here serves the checks that need the files as
data first (a bench recipe, a contested name) and the report of every problem in the files when jsonargparse stops
at the first. The limits are checked here before jsonargparse reads anything, on files and command-line values.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from rlpost.core.user_files import UserFileError, read_yaml_file
from rlpost.core.yaml_limits import YamlLimitError, load_yaml
from rlpost.engine.recipe.paths import resolve_doc_paths
from rlpost.engine.recipe.schema import RecipeError

__all__ = ["check_value_limits", "deep_merge", "merge_sources", "read_yaml", "recipe_files", "string_beyond_limits"]


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Merge ``overlay`` into ``base``. A component whose ``class_path`` changes is replaced, not merged, so an
    overlay swapping the sampler does not inherit the old sampler's arguments."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            swapped = "class_path" in value and old.get("class_path") != value["class_path"]
            out[key] = copy.deepcopy(value) if swapped else deep_merge(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: str, what: str = "recipe file") -> dict[str, Any]:
    """Read one recipe file (or a bench recipe: ``what``) with the limits of :mod:`rlpost.core.yaml_limits` (size,
    nesting, aliases, entries, duplicate keys) and of :func:`rlpost.core.user_files.read_text_file` (a missing,
    non-UTF-8 or irregular file); an empty file is an empty mapping.

    Raises:
        RecipeError: Naming the file and the problem.
    """
    try:
        data = read_yaml_file(path, what)
    except UserFileError as exc:
        raise RecipeError([str(exc)]) from None
    problem = string_beyond_limits(data)
    if problem is not None:
        raise RecipeError([f"{path}: {problem}"])
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: a {what.removesuffix(' file')} must be a YAML mapping, got {type(data).__name__}"])
    return data


def string_beyond_limits(data: Any, where: str = "") -> str | None:
    """The first string in ``data`` that is YAML beyond the limits of :mod:`rlpost.core.yaml_limits`, as a problem
    naming its field, or ``None``. jsonargparse parses a string given for a number, list or mapping field as YAML again,
    with its own loader (``jsonargparse._typehints.adapt_typehints``), so a quoted alias bomb would expand there."""
    if isinstance(data, dict):
        items: Iterable[tuple[str, Any]] = ((f"{where}.{k}" if where else str(k), v) for k, v in data.items())
    elif isinstance(data, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(data))
    elif isinstance(data, str) and any(c in data for c in "*[{"):  # aliases and nesting need one of these
        try:
            load_yaml(data, where)
        except YamlLimitError as exc:
            return f"{where or 'value'}: not valid YAML inside a string: {exc}"
        except yaml.YAMLError:
            pass  # not YAML: an ordinary string
        return None
    else:
        return None
    for key, value in items:
        problem = string_beyond_limits(value, key)
        if problem is not None:
            return problem
    return None


def merge_sources(recipes: Sequence[str]) -> dict[str, Any]:
    """Merge recipe files as plain data, later ones overlaying earlier ones (:func:`deep_merge`), each file's relative
    paths resolved against its directory (:mod:`rlpost.engine.recipe.paths`). Command-line
    options are jsonargparse's: :func:`rlpost.engine.recipe.parse.parse_recipe` merges files and options as
    ``rlpost train`` does.

    Raises:
        RecipeError: If a file is missing or not a YAML mapping, or exceeds a YAML limit (size, nesting, alias
            expansion; see :mod:`rlpost.core.yaml_limits`).
    """
    cfg: dict[str, Any] = {}
    for path in recipes:
        cfg = deep_merge(cfg, resolve_doc_paths(read_yaml(path), path))
    return cfg


def check_value_limits(argv: Sequence[str]) -> None:
    """Refuse a command-line value beyond the YAML limits of :mod:`rlpost.core.yaml_limits` (an alias bomb, say) before
    jsonargparse reads it: for values of plain types (int, float, ...) jsonargparse uses its own YAML loader, not the
    parser mode's (``jsonargparse._typehints.adapt_typehints``), so the limits are checked here first.

    Raises:
        RecipeError: Naming the option whose value is refused.
    """
    option = "command line"
    for token in argv:
        if token.startswith("--"):
            option, _, value = token.partition("=")
        else:
            value = token
        if not value:
            continue
        try:
            loaded = load_yaml(value, option)
        except YamlLimitError as exc:
            raise RecipeError([f"{option}: not valid YAML: {exc}"]) from None
        except yaml.YAMLError:
            continue  # not YAML: a plain string
        if not isinstance(loaded, str):  # a string value is the token itself, checked above
            problem = string_beyond_limits(loaded)
            if problem is not None:
                raise RecipeError([f"{option}: {problem}"])


def recipe_files(argv: Sequence[str]) -> list[str]:
    """The ``--recipe`` files in ``argv``, in order. They are read with :func:`read_yaml` before jsonargparse reads
    them, so that a missing, oversize or non-UTF-8 file is refused with its own message before anything else."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    scan.add_argument("--recipe", action="append", default=[])
    return list(scan.parse_known_args(list(argv))[0].recipe)
