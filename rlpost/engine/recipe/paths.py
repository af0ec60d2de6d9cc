"""Relative paths in a recipe, resolved against the file that wrote them (:mod:`rlpost.core.shipped` states the rule;
``docs/recipes.md``, "Paths in a recipe").

Every string value of a recipe file is a candidate (a model directory, a prompt file, a reward checkpoint, a
DeepSpeed configuration: the recipe does not say which strings are paths, the component does, and only after
validation); a string becomes an absolute path only when it names an existing file or directory next to the recipe
file or among rlpost's shipped ``assets/`` and ``recipes/``, so prompts, names and Hub ids are left as they are. The
output directory (``run.output_dir``) and component names (``class_path``) are never resolved: a run writes where it
is started.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlpost.core.shipped import resolve_relative

__all__ = ["NOT_PATHS", "resolve_argv_recipes", "resolve_doc_paths", "resolve_from_files"]

NOT_PATHS = frozenset({"class_path", "output_dir"})
"""Keys whose string values are never resolved as paths."""


def _map_strings(data: Any, fix: Any, key: str = "") -> Any:
    if isinstance(data, dict):
        return {k: _map_strings(v, fix, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [_map_strings(v, fix, key) for v in data]
    if isinstance(data, str) and key not in NOT_PATHS:
        return fix(data)
    return data


def resolve_doc_paths(doc: dict[str, Any], recipe_file: str | Path) -> dict[str, Any]:
    """``doc`` (one recipe file's data) with its relative paths resolved against ``recipe_file``'s directory."""
    base = Path(recipe_file).resolve().parent
    resolved: dict[str, Any] = _map_strings(doc, lambda s: resolve_relative(s, base))
    return resolved


def _strings(data: Any, key: str = "") -> list[str]:
    if isinstance(data, dict):
        return [s for k, v in data.items() for s in _strings(v, str(k))]
    if isinstance(data, list):
        return [s for v in data for s in _strings(v, key)]
    return [data] if isinstance(data, str) and key not in NOT_PATHS else []


def resolve_from_files(cfg: dict[str, Any], files: Sequence[str], docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``cfg`` (merged by jsonargparse from ``files``, whose data are ``docs``, and command-line options) with each
    string a file wrote resolved against that file's directory (the last file that holds the same string wins, as
    the last file's value wins the merge); other strings (command-line values) by the rule's steps for the current
    directory."""
    written: dict[str, str] = {}
    for path, doc in zip(files, docs, strict=True):
        base = Path(path).resolve().parent
        for text in _strings(doc):
            written[text] = resolve_relative(text, base)
    resolved: dict[str, Any] = _map_strings(cfg, lambda s: written[s] if s in written else resolve_relative(s))
    return resolved


def resolve_argv_recipes(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--recipe`` value that does not exist from the current directory but names a shipped
    recipe (``recipes/treegrpo_digits.yaml``) replaced by the shipped file's absolute path."""
    out = list(argv)
    for i, token in enumerate(out):
        if token.startswith("--recipe="):
            out[i] = "--recipe=" + resolve_relative(token.removeprefix("--recipe="))
        elif token == "--recipe" and i + 1 < len(out):
            out[i + 1] = resolve_relative(out[i + 1])
    return out
