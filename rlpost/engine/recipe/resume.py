"""Resume checks: which changes between a checkpoint's recipe and the resuming one break the saved state.

The sections that carry state are marked in :data:`~rlpost.engine.recipe.schema.SECTIONS` (``state``): compared whole
(the model) or by class path (sampler, advantage, optimizer, torch optimizer, LR scheduler).
"""

from __future__ import annotations

from typing import Any

import yaml
from jsonargparse import ArgumentParser

from rlpost.engine.recipe.schema import COMPONENT_KEYS, SECTION, SECTIONS
from rlpost.engine.recipe.typecheck import with_defaults

__all__ = ["state_breaking_changes"]


def _with_all_defaults(key: str, value: Any) -> Any:
    """The component ``value`` of the recipe field ``key`` with every default filled in, nested dataclass arguments
    (``model.init_args.lora``) included, as jsonargparse's parser fills them (:func:`with_defaults` where jsonargparse
    rejects the value)."""
    if key not in COMPONENT_KEYS or not (isinstance(value, dict) and isinstance(value.get("class_path"), str)):
        return with_defaults(value)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument(f"--{key}", type=SECTION[key].type)
    try:
        return yaml.safe_load(parser.dump(parser.parse_object({key: value}), skip_validation=True))[key]
    except Exception:  # noqa: BLE001 - jsonargparse raises several types; the plain comparison then applies
        return with_defaults(value)


def state_breaking_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Differences between two resolved recipes that make a checkpoint of ``old`` unusable under ``new``."""
    problems = []
    for key in (s.name for s in SECTIONS if s.state == "whole"):
        # Runs saved before recipe.yaml listed constructor defaults compare equal when only the defaults differ.
        if _with_all_defaults(key, old.get(key)) != _with_all_defaults(key, new.get(key)):
            problems.append(f"{key}: changed from {old.get(key)!r} to {new.get(key)!r}")
    for key in (s.name for s in SECTIONS if s.state == "class"):
        a, b = old.get(key) or {}, new.get(key) or {}
        if a.get("class_path") != b.get("class_path"):
            problems.append(f"{key}.class_path: changed from {a.get('class_path')!r} to {b.get('class_path')!r}")
    return problems
