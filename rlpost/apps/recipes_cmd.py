"""``rlpost recipes list`` / ``rlpost recipes copy NAME DEST``: the shipped recipes, to start one's own from
(torchtune's ``tune ls`` / ``tune cp`` habit).

A recipe's NAME is its path under ``recipes/`` without the suffix (``treegrpo_digits``, ``tiny/treegrpo``,
``ablations/treegrpo_leaf_zscore``, ``deepspeed/zero2.json`` keeps ``.json``). The wheel carries ``recipes/`` as
``rlpost/_recipes`` (``pyproject.toml``, hatch ``force-include``), read with :mod:`importlib.resources`; a source
checkout or editable install, where no ``rlpost/_recipes`` exists, reads the checkout's ``recipes/``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # importlib.resources.abc is Python 3.11+; importlib.resources.files returns one at run time
    from importlib.resources.abc import Traversable

__all__ = ["RecipeEntry", "cmd_recipes", "copy_recipe", "find_recipe", "list_recipes", "recipes_root"]

PACKAGED = "_recipes"
"""The folder inside the ``rlpost`` package that holds ``recipes/`` in a wheel."""

SUFFIXES = (".yaml", ".json")
DESCRIPTION_CHARS = 110


class RecipeLookupError(LookupError):
    """No shipped recipe has the given name (the message suggests the nearest ones)."""


@dataclass(frozen=True)
class RecipeEntry:
    """One shipped recipe file.

    Attributes:
        name: Path under ``recipes/`` without ``.yaml`` (``tiny/treegrpo``); JSON files keep ``.json``.
        folder: Its folder under ``recipes/`` (``""`` for the top level).
        kind: ``recipe`` (a whole training recipe), ``overlay`` (sections to merge onto one), ``bench`` (an
            ``rlpost bench`` recipe) or ``json`` (a DeepSpeed configuration).
        description: The first sentence of the file's header comment, shortened to one line.
        base: The recipe an overlay applies to, from its ``# base: recipes/...`` header line, else ``None``.
    """

    name: str
    folder: str
    kind: str
    description: str
    base: str | None


def recipes_root() -> Traversable:
    """Where the shipped recipes are: ``rlpost/_recipes`` in an installed wheel, else the source checkout's
    ``recipes/`` (editable install, or ``PYTHONPATH`` on a checkout).

    Raises:
        FileNotFoundError: Neither exists (a wheel built without them).
    """
    packaged = importlib.resources.files("rlpost").joinpath(PACKAGED)
    if packaged.is_dir():
        return packaged
    import rlpost

    checkout = Path(rlpost.__file__).resolve().parent.parent / "recipes"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"no shipped recipes: neither rlpost/{PACKAGED} in the installed package nor {checkout}")


def _walk(folder: Traversable, prefix: str = "") -> list[tuple[str, Traversable]]:
    """``(relative path, file)`` of every recipe file under ``folder``, sorted."""
    found: list[tuple[str, Traversable]] = []
    for item in sorted(folder.iterdir(), key=lambda t: t.name):
        if item.name.startswith((".", "_")):
            continue
        relative = f"{prefix}{item.name}"
        if item.is_dir():
            found.extend(_walk(item, relative + "/"))
        elif item.name.endswith(SUFFIXES):
            found.append((relative, item))
    return found


def _name(relative: str) -> str:
    return relative.removesuffix(".yaml")


def _header(text: str) -> tuple[str, str | None]:
    """(one-line description, base) from a YAML file's leading comment block.

    The description is the first sentence of the first comment paragraph, skipping the ``# base:`` line and stopping
    at an indented command example (``#   rlpost train ...``).
    """
    base: str | None = None
    words: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:]
        if body.strip().startswith("base:"):
            base = body.strip().removeprefix("base:").strip() or None
            continue
        if body.startswith("   ") or not body.strip():
            if words:
                break
            continue
        words.extend(body.split())
    text = " ".join(words)
    for end in range(len(text)):
        if text[end] == "." and (end + 1 == len(text) or text[end + 1] == " "):
            text = text[: end + 1]
            break
    if len(text) > DESCRIPTION_CHARS:
        text = text[: DESCRIPTION_CHARS - 1].rsplit(" ", 1)[0].rstrip(",;:(") + "…"
    return text, base


def _entry(relative: str, item: Traversable) -> RecipeEntry:
    text = item.read_text(encoding="utf-8")
    folder = relative.rpartition("/")[0]
    if relative.endswith(".json"):
        try:
            keys = list(json.loads(text))
        except (ValueError, TypeError):
            keys = []
        return RecipeEntry(_name(relative), folder, "json", "JSON: " + ", ".join(keys), None)
    description, base = _header(text)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    data = data if isinstance(data, dict) else {}
    if "bench" in data:
        kind = "bench"
    elif "model" in data and "sampler" in data:
        kind = "recipe"
    else:
        kind = "overlay"
    return RecipeEntry(_name(relative), folder, kind, description, base)


def list_recipes(root: Traversable | None = None) -> list[RecipeEntry]:
    """Every shipped recipe, top-level ones first, then folder by folder."""
    entries = [_entry(relative, item) for relative, item in _walk(root or recipes_root())]
    return sorted(entries, key=lambda e: (e.folder != "", e.folder, e.name))


def find_recipe(name: str, root: Traversable | None = None) -> tuple[str, Traversable]:
    """``(name, file)`` of the shipped recipe ``name`` (``tiny/treegrpo``; ``.yaml`` and a leading ``recipes/`` are
    accepted).

    Raises:
        RecipeLookupError: No such recipe; the message names the nearest ones.
    """
    root = root or recipes_root()
    files = dict(_walk(root))
    wanted = name.strip().removeprefix("./").removeprefix("recipes/")
    for candidate in (wanted, f"{wanted}.yaml"):
        if candidate in files:
            return _name(candidate), files[candidate]
    names = [_name(r) for r in files]
    close = difflib.get_close_matches(_name(wanted), names, n=3, cutoff=0.5)
    # A bare file name finds its folder's recipe too (``treegrpo`` -> ``tiny/treegrpo``).
    close += [n for n in names if n.rpartition("/")[2] == _name(wanted).rpartition("/")[2] and n not in close]
    hint = f"; did you mean {' or '.join(repr(c) for c in close[:3])}?" if close else ""
    raise RecipeLookupError(f"unknown recipe {name!r}{hint} (rlpost recipes list shows them all)")


def copy_recipe(name: str, dest: Path, force: bool = False, root: Traversable | None = None) -> Path:
    """Copy the shipped recipe ``name`` to ``dest`` (a file, or an existing directory: ``dest/<file name>``; a
    destination without a suffix gets the recipe's) and return the written path.

    Raises:
        RecipeLookupError: No such recipe.
        FileExistsError: The destination exists and ``force`` is not set (nothing is written).
    """
    name, item = find_recipe(name, root)
    if dest.is_dir():
        dest = dest / item.name
    elif not dest.suffix:
        dest = dest.with_name(dest.name + Path(item.name).suffix)
    if dest.exists() and not force:
        raise FileExistsError(f"{dest} exists; choose another destination or pass --force to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(item.read_bytes())
    return dest


def _print_table(entries: list[RecipeEntry]) -> None:
    console = Console()
    tables = []
    for folder in dict.fromkeys(e.folder for e in entries):
        rows = [e for e in entries if e.folder == folder]
        based = any(e.base for e in rows)  # overlays naming the recipe they apply to
        table = Table(title=f"recipes/{folder + '/' if folder else ''}", title_justify="left")
        for column in ("name", "kind", "description", *(["base"] if based else [])):
            table.add_column(column)
        for e in rows:
            table.add_row(e.name, e.kind, e.description, *([e.base or ""] if based else []))
        tables.append(table)
    if not console.is_terminal:  # piped or redirected: as wide as the tables need, never truncated to 80 columns
        width = max(Console(width=100_000).measure(t).maximum for t in tables)
        console = Console(width=max(80, width))
    for table in tables:
        console.print(table)


def cmd_recipes(argv: Sequence[str]) -> int:
    """List the shipped recipes, or copy one to edit it."""
    parser = argparse.ArgumentParser(prog="rlpost recipes", description=cmd_recipes.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("list", help="the shipped recipes with a one-line description, by folder")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    cp = sub.add_parser("copy", help="copy a shipped recipe to edit it")
    cp.add_argument("name", help="recipe name as `rlpost recipes list` shows it (e.g. tiny/treegrpo)")
    cp.add_argument("dest", help="destination file, or an existing directory")
    cp.add_argument("--force", action="store_true", help="overwrite an existing destination")
    ns = parser.parse_args(argv)
    try:
        if ns.action == "list":
            entries = list_recipes()
            if ns.json:
                print(json.dumps([asdict(e) for e in entries], indent=2, ensure_ascii=False))
            else:
                _print_table(entries)
            return 0
        written = copy_recipe(ns.name, Path(ns.dest), ns.force)
    except (RecipeLookupError, FileExistsError, FileNotFoundError) as exc:
        print(f"rlpost recipes: {exc}", file=sys.stderr)
        return 2
    print(f"copied {ns.name} to {written}", file=sys.stderr)
    return 0
