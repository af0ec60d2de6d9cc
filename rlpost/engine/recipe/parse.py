"""The recipe's jsonargparse parser, shared by ``rlpost train``/``validate``, the bench and :func:`load_recipe`.

``--recipe`` files (jsonargparse's ``ActionConfigFile``; later files overlay earlier ones) and one option per recipe
field (components typed by their base class, so ``--sampler.k 3``, ``--sampler.init_args.k 3`` and
``--sampler.help CLASS`` are jsonargparse's own) are merged in command-line order by jsonargparse itself. Around it:
the YAML limits on every file and value (:mod:`~rlpost.engine.recipe.sources`), registered component names resolved
to class paths (:mod:`~rlpost.engine.recipe.names`), and every problem reported at once, each naming its field.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import re
import typing
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import yaml
from jsonargparse import ArgumentParser, Namespace, set_loader
from jsonargparse._actions import ActionConfigFile  # documented as jsonargparse.ActionConfigFile, not re-exported

from rlpost.core.registry import Registries, suggest
from rlpost.core.yaml_limits import load_yaml
from rlpost.engine.evaluation.alarm import AlarmConfig
from rlpost.engine.evaluation.config import SETTING_HELP, EvalSettings
from rlpost.engine.recipe.names import refuse_contested, resolve_argv_names, resolve_names
from rlpost.engine.recipe.paths import resolve_argv_recipes, resolve_from_files
from rlpost.engine.recipe.schema import (
    EVAL_SECTIONS,
    MAX_PROBLEM_CHARS,
    MAX_PROBLEMS_SHOWN,
    SECTION,
    SECTIONS,
    Recipe,
    RecipeError,
    Section,
    clip_text,
)
from rlpost.engine.recipe.shapes import shape_problems
from rlpost.engine.recipe.sources import check_value_limits, merge_sources, read_yaml, recipe_files
from rlpost.engine.recipe.typecheck import clean_message, unknown_option_problem
from rlpost.engine.recipe.validate import validate

__all__ = [
    "RECIPE_PARSER_MODE",
    "build_parser",
    "command_line_value",
    "load_recipe",
    "parse_recipe",
    "parse_recipe_args",
]

RECIPE_PARSER_MODE = "rlpost-recipe"
"""jsonargparse parser mode whose loader is :func:`_recipe_loader` (limited YAML, registered component names)."""

_PARSE_HOST: ContextVar[Registries | None] = ContextVar("rlpost_recipe_parse_host", default=None)


def _recipe_loader(text: str) -> Any:
    """The YAML loader jsonargparse uses for ``--recipe`` files and command-line values (registered below with
    ``jsonargparse.set_loader``; https://jsonargparse.readthedocs.io/en/stable/#custom-loaders): the limits of
    :mod:`rlpost.core.yaml_limits` (size, nesting, alias expansion) apply to everything jsonargparse loads. In a recipe
    document, registered short component names (``sampler: tree``) become dotted class paths, because jsonargparse
    resolves a ``class_path`` only from an import path or a subclass's class name
    (https://jsonargparse.readthedocs.io/en/stable/#class-type-and-subclasses), not from a plugin registry."""
    data = load_yaml(text, "recipe")
    host = _PARSE_HOST.get()
    if host is not None and isinstance(data, dict):
        data = resolve_names(data, host, contested_to_registered=True)
    return data


set_loader(RECIPE_PARSER_MODE, _recipe_loader, exceptions=(yaml.YAMLError,))


def parse_recipe_args(
    parser: ArgumentParser, argv: Sequence[str], host: Registries
) -> tuple[dict[str, Any], Namespace]:
    """Parse a ``train``/``validate`` command line with ``parser`` (see :func:`build_parser`): jsonargparse merges
    the ``--recipe`` files and the ``--a.b value`` options in command-line order. Returns the merged recipe (for
    :func:`validate`) and jsonargparse's namespace (for the options that are not recipe fields).

    jsonargparse stops at the first problem; :func:`_parse_problems` then lists every problem (a recipe's problems
    are reported all at once).

    Raises:
        RecipeError: If there is no recipe file, a file is unreadable or a bench recipe, or parsing fails.
        SystemExit: After jsonargparse printed a help text (``--help``, ``--KEY.help NAME``).
    """
    argv = resolve_argv_recipes(argv)  # recipes/NAME.yaml names the shipped recipe from any directory
    files = recipe_files(argv)
    docs = [read_yaml(path) for path in files]
    bench = [path for path, doc in zip(files, docs, strict=True) if "bench" in doc]
    if bench:  # a bench recipe describes several training recipes, not one
        raise RecipeError(
            [
                f"{bench[0]} is a bench recipe (top-level 'bench:' key); run it with rlpost bench --recipe "
                f"{bench[0]}, or validate/train one of the recipes it benchmarks"
            ]
        )
    check_value_limits(argv)
    # jsonargparse drops or misreads a section of the wrong shape (rlpost/engine/recipe/shapes.py): refuse it first.
    shapes = [f"{p} (in {path})" for path, doc in zip(files, docs, strict=True) for p in shape_problems(doc)]
    if shapes:
        raise RecipeError(shapes)
    refuse_contested(argv, docs, host)
    token = _PARSE_HOST.set(host)
    try:
        args = resolve_argv_names(argv, host)
        if not files and not any(a in ("-h", "--help") or a.split("=")[0].endswith(".help") for a in args):
            raise RecipeError(["give at least one --recipe FILE"])
        try:
            namespace = parser.parse_args(args)
        except argparse.ArgumentError as exc:
            raise RecipeError(_parse_problems(parser, files, args, host, str(exc))) from None
    finally:
        _PARSE_HOST.reset(token)
    # Relative paths resolve against the file that wrote them (rlpost/core/shipped.py states the rule).
    return resolve_from_files(_recipe_from_namespace(parser, namespace), files, docs), namespace


def _parse_problems(
    parser: ArgumentParser, files: list[str], args: list[str], host: Registries, message: str
) -> list[str]:
    """Every problem of a command line jsonargparse rejected with ``message`` (it stops at the first one).

    When the recipe files alone fail too, :func:`validate` reports every problem in them, in its own words (raising
    RecipeError). Otherwise the problem is in the ``--a.b value`` options: each jsonargparse error names its
    top-level field, and the command line is parsed again without that field's options to find the next one.
    """
    try:
        parser.parse_args([arg for path in files for arg in ("--recipe", path)])
    except argparse.ArgumentError:
        validate(merge_sources(files), host)  # raises with every problem of the files
    problems: list[str] = []
    while len(problems) < MAX_PROBLEMS_SHOWN:
        problem, where = _parse_problem(message)
        problems.append(problem)
        remaining = _without_field(args, where) if where else args
        if remaining == args:
            break
        args = remaining
        try:
            parser.parse_args(args)
            break
        except argparse.ArgumentError as exc:
            message = str(exc)
    return problems


def _without_field(args: list[str], where: str) -> list[str]:
    """``args`` without the options ``--WHERE`` and ``--WHERE.*`` (each with its value: recipe fields take one)."""
    out: list[str] = []
    skip = False
    for token in args:
        if skip:
            skip = False
            continue
        option, eq, _ = token.partition("=")
        if option == f"--{where}" or option.startswith(f"--{where}."):
            skip = not eq
            continue
        out.append(token)
    return out


def _parse_problem(message: str) -> tuple[str, str | None]:
    """jsonargparse's parse error as a recipe problem naming the field path, with the nearest name for an unknown
    option, and the top-level field it names (``None`` when it names none)."""
    match = re.match(r'\s*Parser key "([^"]+)":', message)
    ambiguous = re.match(r"\s*ambiguous option: --([^\s=]+) could match", message)
    if ambiguous is not None and ambiguous.group(1) in SECTION:  # --eval VALUE: the section has no option of its own
        name = ambiguous.group(1)
        return f"--{name}: set the section's fields one by one (--{name}.FIELD VALUE) or in a recipe file", None
    if match is None:
        unrecognized = re.match(r"\s*[Uu]nrecognized arguments: --([^\s=]+)", message)
        if unrecognized is not None:  # an option that is no recipe field
            name = unrecognized.group(1)
            top, _, rest = name.partition(".")
            section = SECTION.get(top)
            if rest and section is not None and section.kind == "config" and dataclasses.is_dataclass(section.type):
                # a misspelt field of a settings section: its nearest fields, as in a recipe file
                problem = unknown_option_problem(top, section.type, {}, f"Option '{rest}' is not accepted")
                if problem is not None:
                    return problem, top
            return f"--{name}: unknown option{suggest(top, list(SECTION))}", None
        return clip_text(" ".join(message.split()), MAX_PROBLEM_CHARS), None
    where = match.group(1)
    not_loaded = re.search(r"Unable to load config '([^']*)'", message)
    if not_loaded is not None:  # a settings group given a value that is neither a mapping nor a readable file
        return f"{where}: expected a mapping of its settings or a settings file, got {not_loaded.group(1)!r}", where
    # "Problem with given class_path 'X'" (classes) or "Got value: Namespace(class_path='X', ...)" (callables)
    given = re.search(r"given class_path '([^']+)'|class_path='([^']+)'", message)
    if given is not None:
        class_path = given.group(1) or given.group(2)
        module_name, _, attr = class_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError):
            cls = None
        if dataclasses.is_dataclass(cls):
            unknown = unknown_option_problem(where, cls, {}, message)
        else:
            unknown = unknown_option_problem(where, None, {"class_path": class_path}, message)
        if unknown is not None:
            return unknown, where
    scalar = re.search(r"Given value type: <class '(\w+)'> Given value: (.*)$", " ".join(message.split()))
    section = SECTION.get(where)
    if scalar is not None and scalar.group(1) in ("str", "int", "float", "bool", "list") and section is not None:
        if section.kind == "config":  # an optional settings section given a scalar or a list
            return f"{where}: expected a mapping of its settings or null, got {scalar.group(2)!r}", where
    return f"{where}: {clean_message(message, where)}", where


def _recipe_from_namespace(parser: ArgumentParser, namespace: Namespace) -> dict[str, Any]:
    """The recipe fields of jsonargparse's ``namespace`` as plain data: unset components are left out (so
    :func:`validate` reports required ones as missing), as is an ``eval`` section with no component and only default
    settings (evaluation is optional)."""
    dumped = yaml.safe_load(parser.dump(namespace, skip_validation=True)) or {}
    cfg = {k: v for k, v in dumped.items() if k in SECTION and not (v is None and SECTION[k].required)}
    section = cfg.pop("eval", None)
    if isinstance(section, dict):
        section = {k: v for k, v in section.items() if v is not None}
        defaults = dataclasses.asdict(EvalSettings())
        if set(section) - set(defaults) or any(section.get(k, v) != v for k, v in defaults.items()):
            cfg["eval"] = section
    return cfg


def build_parser(prog: str = "rlpost train") -> ArgumentParser:
    """The jsonargparse parser of a recipe: ``--recipe`` files (``ActionConfigFile``; later files overlay earlier
    ones) and one option per recipe field (components typed by their base class, so ``--sampler.k 3``,
    ``--sampler.init_args.k 3`` and ``--sampler.help CLASS`` are jsonargparse's own)."""
    parser = ArgumentParser(
        prog=prog,
        description="Train with a recipe; every option below can be set in the recipe YAML or as --a.b VALUE.",
        exit_on_error=False,
        parser_mode=RECIPE_PARSER_MODE,
        # rlpost's --print_config prints the recipe after validate() resolved it (rlpost/apps/cli.py), not
        # jsonargparse's unvalidated namespace: https://jsonargparse.readthedocs.io/en/stable/#writing-configuration-files
        print_config=None,
    )
    parser.add_argument(
        "--recipe", action=ActionConfigFile, help="recipe YAML file; repeat to overlay later files on earlier ones"
    )
    for section in SECTIONS:
        _add_arguments(parser, section)
    return parser


def _add_arguments(parser: ArgumentParser, s: Section) -> None:
    """The command-line option(s) of one recipe section."""
    if s.kind == "config" and not s.optional:
        parser.add_class_arguments(s.type, s.name)
    elif s.kind == "eval":  # every key optional: the section is off unless it names a prompt source
        group = parser.add_argument_group(s.name, s.help)
        for e in EVAL_SECTIONS:
            group.add_argument(f"--eval.{e.name}", type=e.option_type() | None, default=None, help=e.help)
        group.add_argument(
            "--eval.alarm",
            type=AlarmConfig | None,
            default=None,
            help="reward-hacking alarm (rlpost.engine.evaluation.alarm)",
        )
        hints = typing.get_type_hints(EvalSettings)
        for f in dataclasses.fields(EvalSettings):
            group.add_argument(f"--eval.{f.name}", type=hints[f.name], default=f.default, help=SETTING_HELP[f.name])
    elif s.optional:
        parser.add_argument(f"--{s.name}", type=s.option_type() | None, default=None, help=s.help)
    elif s.kind == "mapping":
        parser.add_argument(f"--{s.name}", type=s.type, default={}, help=s.help)
    else:
        parser.add_argument(f"--{s.name}", type=s.option_type(), help=s.help)


def parse_recipe(recipes: Sequence[str], overrides: Sequence[tuple[str, str]], host: Registries) -> dict[str, Any]:
    """The merged recipe of ``recipes`` and ``--a.b value`` ``overrides``, parsed exactly as ``rlpost train --recipe
    R1 --recipe R2 ... --a.b value ...`` parses them (:func:`parse_recipe_args` with :func:`build_parser`).

    Args:
        recipes: Recipe files, later ones overlaying earlier ones.
        overrides: ``("a.b", "value")`` pairs, applied after the files in order; values are YAML (``("sampler.k",
            "3")``, ``("eval.sets", "{heldout: {...}}")``).
        host: Where component names resolve.

    Raises:
        RecipeError: As :func:`parse_recipe_args`, and for an override that is no recipe field but a help request.
    """
    helps = [key for key, _ in overrides if key == "help" or key.endswith(".help")]
    if helps:
        raise RecipeError([f"--{key}: asks for a help text; overrides set recipe fields" for key in helps])
    argv = [token for path in recipes for token in ("--recipe", path)]
    argv += [f"--{key}={value}" for key, value in overrides]  # '=': a value may start with '-'
    return parse_recipe_args(build_parser(), argv, host)[0]


def command_line_value(value: Any) -> str:
    """``value`` as the text to give after ``--a.b`` for jsonargparse to read it back as ``value``: a string as it is
    (jsonargparse reads the value of a string field verbatim, quotes included), anything else as one line of YAML
    flow in the mapping's own order (``3``, ``.inf``, ``{heldout: {class_path: digit-prompts}}``), which jsonargparse
    parses by the field's type."""
    if isinstance(value, str):
        return value
    text = str(yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=math.inf)).strip()
    return text.removesuffix("\n...").strip()  # a scalar's document-end marker


def load_recipe(recipes: Sequence[str], overrides: Sequence[tuple[str, str]], host: Registries) -> Recipe:
    """Parse (:func:`parse_recipe`), validate and instantiate a recipe (:func:`~rlpost.engine.recipe.validate`)."""
    return validate(parse_recipe(recipes, overrides, host), host)
