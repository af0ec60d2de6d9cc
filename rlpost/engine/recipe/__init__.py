"""Recipes: YAML files (with overlays and ``--a.b value`` overrides) that choose and configure every component.

Components are chosen by their registered short name (``tree``), their class name, or a dotted ``class_path``,
with arguments in ``init_args`` (``{class_path: tree, k: 3}`` is accepted as shorthand). Swapping one component is
a one-line overlay. Validation (:func:`validate`) reports **all** problems at once, each naming its field, before any
model is loaded: jsonargparse checks types and argument names per component, then cross-component checks run.

One module per responsibility (each imports its siblings directly; this package only re-exports):

* :mod:`~rlpost.engine.recipe.schema`: the sections (:data:`SECTIONS`), :class:`RunConfig`, :class:`Recipe`,
  :class:`RecipeError`;
* :mod:`~rlpost.engine.recipe.sources`: recipe files read within the YAML limits and merged as plain data;
* :mod:`~rlpost.engine.recipe.names`: component names resolved to class paths, contested names refused;
* :mod:`~rlpost.engine.recipe.shapes`: the shape each section's value must have, checked before jsonargparse reads it;
* :mod:`~rlpost.engine.recipe.typecheck`: jsonargparse type checks with problems naming the field (and the arguments a
  component's constructor refused);
* :mod:`~rlpost.engine.recipe.validate`: :func:`validate`, every problem at once (the ``eval`` section by
  :mod:`rlpost.engine.evaluation.section`);
* :mod:`~rlpost.engine.recipe.resume`: the changes that break a checkpoint's state;
* :mod:`~rlpost.engine.recipe.parse`: the jsonargparse parser of ``rlpost train``, :func:`parse_recipe`,
  :func:`load_recipe`.
"""

from __future__ import annotations

from rlpost.engine.recipe.parse import (
    RECIPE_PARSER_MODE,
    build_parser,
    command_line_value,
    load_recipe,
    parse_recipe,
    parse_recipe_args,
)
from rlpost.engine.recipe.resume import state_breaking_changes
from rlpost.engine.recipe.schema import (
    COMPONENT_KEYS,
    EVAL_SECTIONS,
    MAX_PROBLEM_CHARS,
    MAX_PROBLEMS_SHOWN,
    SECTION,
    SECTIONS,
    OptimizerFactory,
    Recipe,
    RecipeError,
    RunConfig,
    SchedulerFactory,
    Section,
    device_problem,
)
from rlpost.engine.recipe.sources import merge_sources
from rlpost.engine.recipe.typecheck import with_defaults
from rlpost.engine.recipe.validate import build_section, recipe_components, validate

__all__ = [
    "COMPONENT_KEYS",
    "EVAL_SECTIONS",
    "MAX_PROBLEMS_SHOWN",
    "MAX_PROBLEM_CHARS",
    "RECIPE_PARSER_MODE",
    "SECTION",
    "SECTIONS",
    "OptimizerFactory",
    "Recipe",
    "RecipeError",
    "RunConfig",
    "SchedulerFactory",
    "Section",
    "build_parser",
    "build_section",
    "command_line_value",
    "device_problem",
    "load_recipe",
    "merge_sources",
    "parse_recipe",
    "parse_recipe_args",
    "recipe_components",
    "state_breaking_changes",
    "validate",
    "with_defaults",
]
