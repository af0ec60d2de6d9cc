"""Validation of the recipe's ``eval`` section (:mod:`rlpost.engine.evaluation.config`), called by the recipe's.

:func:`validate_eval` checks the prompt sets (:mod:`~rlpost.engine.evaluation.prompt_sets`), the rewards and second
judges (:mod:`~rlpost.engine.evaluation.judges`), the alarm (:mod:`~rlpost.engine.evaluation.alarm`) and the settings,
recording every problem under its field (``eval.sets.heldout.class_path``, ``eval.judges[0]``, ``eval.alarm.window``);
:func:`component_problems` re-homes the evaluation components' own ``validate()`` problems to their fields. Components
are resolved and type-checked through the recipe's :class:`~rlpost.engine.evaluation.config.ComponentChecks`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlpost.core.registry import suggest
from rlpost.engine.evaluation.alarm import AlarmConfig
from rlpost.engine.evaluation.config import ComponentChecks, EvalSettings, EvalSpec
from rlpost.engine.evaluation.judges import validate_judges, validate_rewards
from rlpost.engine.evaluation.keys import set_field
from rlpost.engine.evaluation.prompt_sets import validate_sets
from rlpost.ops.media import media_problems

__all__ = ["COMPONENTS", "component_problems", "validate_alarm", "validate_eval"]

COMPONENTS = ("prompts", "sets", "rewards", "judges")
"""The keys of ``eval`` that hold components (the recipe parser's ``EVAL_SECTIONS``); ``alarm`` and the
:class:`EvalSettings` fields are its other keys."""


def validate_eval(
    value: Any, train_rewards: list[Any], built: dict[str, Any], checks: ComponentChecks, problems: list[str]
) -> tuple[EvalSpec | None, Any]:
    """Validate the ``eval`` section: prompt source(s), reward sources (default: the training rewards), second judges
    (never training rewards), the alarm and settings.

    Args:
        value: The section as plain data.
        train_rewards: The resolved training rewards (the default evaluation rewards).
        built: The sections built so far (``built["rewards"]``: the training reward instances).
        checks: How the recipe resolves and type-checks components.
        problems: Where every problem is recorded.

    Returns:
        The validated section (``None`` when it has a problem) and its resolved plain data.
    """
    if not isinstance(value, dict):
        problems.append(
            f"eval: expected a mapping (prompts or sets, rewards, judges, num_steps, every, seed, batch_size), got "
            f"{value!r}"
        )
        return None, value
    components = (*COMPONENTS, "alarm")
    known = (*components, *(f.name for f in dataclasses.fields(EvalSettings)))
    for key in value:
        if key not in known:
            problems.append(f"eval.{key}: unknown key{suggest(key, list(known))}")
    start = len(problems)
    settings_raw = {k: v for k, v in value.items() if k not in components and k in known}
    settings = checks.check("eval", EvalSettings, settings_raw, problems, "eval")
    resolved: dict[str, Any] = {}
    sets = validate_sets(value, checks, problems, resolved)
    rewards = validate_rewards(value, train_rewards, built, checks, problems, resolved)
    names = [r.name for r in rewards]
    judges = validate_judges(value, built, names, checks, problems, resolved)
    trained = [n for n in names if n in {r.name for r in built.get("rewards") or []}]
    alarm = validate_alarm(value.get("alarm"), trained, checks, problems, resolved)
    if settings is not None:
        resolved.update(dataclasses.asdict(settings))
        problems.extend(f"eval.{p}" for p in settings.problems())
    if len(problems) > start or sets is None or settings is None:
        return None, resolved
    spec = EvalSpec(sets=sets, rewards=rewards, judges=judges, settings=settings, alarm=alarm, trained=trained)
    return spec, resolved


def validate_alarm(
    raw: Any, trained: list[str], checks: ComponentChecks, problems: list[str], resolved: dict[str, Any]
) -> AlarmConfig | None:
    """``eval.alarm`` (:mod:`rlpost.engine.evaluation.alarm`): type and range checks (the config's own
    ``problems()``); an enabled alarm needs a trained reward to watch."""
    if raw is None:
        return None
    alarm: AlarmConfig | None = checks.check("alarm", AlarmConfig, raw, problems, "eval.alarm")
    if alarm is None:
        return None
    resolved["alarm"] = dataclasses.asdict(alarm)
    problems.extend(alarm.problems())
    if alarm.enabled and not trained:
        problems.append(
            "eval.alarm: enabled, but no evaluation reward is a training reward (the alarm watches the trained reward "
            "on the evaluation images: keep it in eval.rewards)"
        )
    return alarm


def component_problems(spec: EvalSpec, recipe: Any) -> list[str]:
    """The evaluation components' own ``validate(recipe)`` problems under their fields: a prompt source names the
    training field ``prompts``, so its problems are re-homed to ``eval.sets.<name>`` (or ``eval.prompts``), a judge's
    from ``rewards`` to ``eval.judges[i]``."""
    problems: list[str] = []
    for name, source in spec.sets.items():
        problems.extend(_refield(p, "prompts", set_field(name)) for p in source.validate(recipe))
    for i, judge in enumerate(spec.judges):
        problems.extend(_refield(p, "rewards", f"eval.judges[{i}]") for p in judge.validate(recipe))
    # Evaluation rewards not trained on (the trained ones are checked under ``rewards``) and judges must score what
    # the model generates.
    extra = [(f"eval.rewards[{i}]", r) for i, r in enumerate(spec.rewards) if not any(r is t for t in recipe.rewards)]
    judges = [(f"eval.judges[{i}]", j) for i, j in enumerate(spec.judges)]
    problems.extend(media_problems(recipe.model, extra + judges))
    return problems


def _refield(problem: str, field_name: str, where: str) -> str:
    """Re-home a component's problem from the training field it assumes (``prompts...``) to ``where``, including
    the command-line flags it suggests (``--prompts.path`` becomes ``--eval.sets.NAME.path``)."""
    problem = problem.replace(f"--{field_name}.", f"--{where}.")
    for sep in (".", ":", "["):
        if problem.startswith(field_name + sep):
            return where + problem[len(field_name) :]
    return f"{where}: {problem}"
