"""The evaluation's prompt sets: ``eval.prompts`` (one unnamed set) or ``eval.sets`` (named ones), checked and loaded.

A set's name becomes a metric path segment and a directory name (:data:`~rlpost.engine.evaluation.keys.SET_NAME_RE`);
the single ``eval.prompts`` source is the set ``""``, whose metrics keep the short names ``eval/<reward>``.
"""

from __future__ import annotations

from typing import Any

from rlpost.core.api import PromptSource
from rlpost.engine.evaluation.config import ComponentChecks
from rlpost.engine.evaluation.keys import JUDGE, SET_NAME_RE, set_field

__all__ = ["load_sets", "validate_sets"]

PromptItems = list[tuple[str, dict[str, Any]]]
"""A set's prompts with their metadata, in the source's order."""


def validate_sets(
    value: dict[str, Any], checks: ComponentChecks, problems: list[str], resolved: dict[str, Any]
) -> dict[str, PromptSource] | None:
    """``eval.prompts`` (one source: the unnamed set ``""``) or ``eval.sets`` (named sources), exactly one.

    Records each resolved source in ``resolved`` (``prompts`` or ``sets``) and every problem in ``problems``.

    Returns:
        The prompt sources by set name, or ``None`` when any of them has a problem.
    """
    if "prompts" in value and "sets" in value:
        problems.append("eval.sets: give either eval.prompts (one prompt source) or eval.sets (named ones), not both")
        return None
    if "prompts" not in value and "sets" not in value:
        problems.append(
            "eval.prompts: missing (a prompt source with the held-out prompts, or eval.sets: {name: source, ...})"
        )
        return None
    if "prompts" in value:
        raw: dict[str, Any] = {"": value["prompts"]}
    elif not isinstance(value["sets"], dict) or not value["sets"]:
        problems.append(f"eval.sets: expected a non-empty mapping of set name to prompt source, got {value['sets']!r}")
        return None
    else:
        raw = value["sets"]
    sets: dict[str, PromptSource] = {}
    resolved_sets: dict[str, Any] = {}
    for name, item in raw.items():
        where = set_field(name)
        if name and (not isinstance(name, str) or not SET_NAME_RE.match(name) or name == JUDGE):
            problems.append(
                f"{where}: bad set name {name!r} (letters, digits, '_', '-', '.'; not starting with a symbol; not "
                f"{JUDGE!r})"
            )
            continue
        pv = checks.resolve(item, where, "prompts", problems)
        if pv is None:
            continue
        resolved_sets[name] = pv
        got = checks.check("prompts", PromptSource, pv, problems, where)
        if got is not None:
            sets[name] = got
    if "prompts" in value:
        resolved["prompts"] = resolved_sets.get("")
    else:
        resolved["sets"] = resolved_sets
    return sets if len(sets) == len(raw) else None


def load_sets(sets: dict[str, PromptSource]) -> dict[str, PromptItems]:
    """Every set's prompts and metadata, loaded once when the run starts.

    Raises:
        ValueError: When a prompt source returns no prompts (naming its field).
    """
    items: dict[str, PromptItems] = {}
    for name, source in sets.items():
        loaded = [(p, dict(m)) for p, m in source.load()]
        if not loaded:
            raise ValueError(f"{set_field(name)}: the held-out prompt source returned no prompts")
        items[name] = loaded
    return items
