"""Validation of a merged recipe: every section type-checked by its kind, range checks, cross-checks and the
components' own checks, all problems at once, each naming its field (:func:`validate`).

The ``eval`` section is validated by :func:`rlpost.engine.evaluation.validate_eval` through the same component
checks (:class:`_Components` is its :class:`~rlpost.engine.evaluation.ComponentChecks`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from rlpost.core.api import Component, missing_capabilities
from rlpost.core.registry import Registries, suggest
from rlpost.core.yaml_limits import short_repr
from rlpost.engine.distributed import validate_distributed
from rlpost.engine.evaluation.section import component_problems, validate_eval
from rlpost.engine.lr_schedule import is_run_length_lr
from rlpost.engine.recipe.names import resolve_component
from rlpost.engine.recipe.schema import SECTION, SECTIONS, OptimizerFactory, Recipe, RecipeError, Section
from rlpost.engine.recipe.shapes import section_shape_problems
from rlpost.engine.recipe.typecheck import check_with_parser, with_defaults
from rlpost.engine.weight_copies import copies_problems
from rlpost.models.acceleration import acceleration_problems
from rlpost.models.adapter_settings import peft_lora_names
from rlpost.ops.media import media_problems

__all__ = ["build_section", "recipe_components", "validate"]


def validate(cfg: dict[str, Any], host: Registries) -> Recipe:
    """Validate a merged recipe and instantiate its components (no weights are loaded).

    Each section in :data:`SECTIONS` is checked for its kind's shape (:mod:`~rlpost.engine.recipe.shapes`), then
    type-checked and instantiated by its kind (a component's constructor checks its declared argument ranges); the
    range problems of the config sections (their ``problems()``) and the checks across sections follow, then the
    components' own ``validate``.

    Args:
        cfg: The merged recipe as plain data.
        host: Where component names resolve: the component registries (the plugin host provides them).

    Raises:
        RecipeError: Listing every problem found, each naming the offending field.
    """
    problems = [f"{key}: unknown top-level key{suggest(key, list(SECTION))}" for key in cfg if key not in SECTION]
    if "model" in cfg:  # LoRA settings may use peft's names (r, lora_alpha); recipe.yaml stores rlpost's
        model, lora_problems = peft_lora_names(cfg["model"])
        cfg = {**cfg, "model": model}
        problems += lora_problems
    problems += [f"{s.name}: missing (required)" for s in SECTIONS if s.required and s.name not in cfg]
    checks = _SectionChecks(cfg, host, problems)
    for section in SECTIONS:
        checks.check(section)
    built, resolved = checks.built, checks.resolved
    # Range problems are reported with every other problem; the component checks below need a sane run section.
    range_problems = _range_problems(cfg, built)
    if problems:
        raise RecipeError(problems + range_problems)
    reward_names = [r.name for r in built["rewards"]]
    problems = range_problems + _check_rewards(reward_names, built["reward_weights"])
    built["reward_weights"] = {name: float(built["reward_weights"].get(name, 1.0)) for name in reward_names}
    resolved["reward_weights"] = built["reward_weights"]
    recipe = Recipe(config=resolved, **built)
    problems.extend(_cross_checks(recipe, sane_run=not range_problems))
    if problems:
        raise RecipeError(problems)
    return recipe


def build_section(cfg: dict[str, Any], name: str, host: Registries) -> Any:
    """Validate and instantiate one top-level section of a recipe alone (no weights are loaded): what a command that
    needs only that part builds (``rlpost sample`` builds the ``model``, so a run samples on a host without its reward
    plugins or prompt files). No checks across sections run and no component's ``validate`` is called.

    Raises:
        RecipeError: The section is missing (when required) or does not validate, each problem naming its field.
    """
    section = SECTION[name]
    problems = [f"{name}: missing (required)"] if section.required and name not in cfg else []
    checks = _SectionChecks(cfg, host, problems)
    if not problems:
        checks.check(section)
    if problems:
        raise RecipeError(problems)
    return checks.built.get(name)


def recipe_components(cfg: dict[str, Any], host: Registries) -> list[tuple[str, Component]]:
    """The recipe's components as ``(field, component)``, constructed (each argument type- and range-checked) but
    without the components' own ``validate``, which checks that their files are installed: what ``rlpost download``
    asks for the files to install (``Component.hub_files``).

    Raises:
        RecipeError: The recipe has problems before any component check (every one listed).
    """
    problems = [f"{key}: unknown top-level key{suggest(key, list(SECTION))}" for key in cfg if key not in SECTION]
    checks = _SectionChecks(cfg, host, problems)
    for section in SECTIONS:
        checks.check(section)
    if problems:
        raise RecipeError(problems)
    found: list[tuple[str, Component]] = []
    for name, value in checks.built.items():
        if isinstance(value, Component):
            found.append((name, value))
        elif isinstance(value, list):
            found.extend((f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, Component))
    spec = checks.built.get("eval")
    if spec is not None:
        found.extend((f"eval.sets.{k}" if k else "eval.prompts", v) for k, v in spec.sets.items())
        found.extend((f"eval.rewards[{i}]", v) for i, v in enumerate(spec.rewards))
        found.extend((f"eval.judges[{i}]", v) for i, v in enumerate(spec.judges))
    return found


class _SectionChecks:
    """Type-checks one recipe section per :meth:`check` call, by its :attr:`Section.kind`, into
    ``built`` (the instantiated section, ``None`` when an optional one is off) and ``resolved`` (its plain data with
    registered names resolved and defaults filled in), recording problems."""

    def __init__(self, cfg: dict[str, Any], host: Registries, problems: list[str]) -> None:
        self.cfg, self.host, self.problems = cfg, host, problems
        self.built: dict[str, Any] = {}
        self.resolved: dict[str, Any] = {}

    def check(self, s: Section) -> None:
        """Check the top-level section ``s`` by its kind, once its value has the kind's shape (a section of the
        wrong shape is recorded as a problem and left unbuilt)."""
        shape = section_shape_problems(s, self.cfg.get(s.name))
        if shape:
            self.problems.extend(shape)
            self.built[s.name] = [] if s.kind == "component-list" else {} if s.kind == "mapping" else None
            self.resolved[s.name] = self.cfg[s.name]
            return
        by_kind = {
            "config": self.config,
            "config-mapping": self.config_mapping,
            "component": self.component,
            "component-list": self.component_list,
            "factory": self.factory,
            "mapping": self.mapping,
            "eval": self.eval,
        }
        by_kind[s.kind](s)

    def config(self, s: Section) -> None:
        """A dataclass, type-checked by jsonargparse (absent: its defaults, or ``None`` when optional)."""
        raw = self.cfg.get(s.name)
        self.built[s.name] = None
        if raw is not None or not s.optional:
            built = self.built[s.name] = check_with_parser(s.name, s.type, raw or {}, self.problems)
            self.resolved[s.name] = _without_folded(s.type, dataclasses.asdict(built)) if built is not None else raw

    def config_mapping(self, s: Section) -> None:
        """Name -> settings dataclass (the weight ``copies``), each type-checked as :meth:`config` under ``NAME.KEY``
        and range-checked with its ``problems()``."""
        raw = self.cfg.get(s.name)
        self.built[s.name] = None
        if raw is None:
            return
        built: dict[str, Any] = {}
        for key, value in raw.items():
            where = f"{s.name}.{key}"
            item = check_with_parser(s.name, s.type, value or {}, self.problems, where=where)
            if item is not None:
                built[str(key)] = item
                self.problems.extend(f"{where}.{p}" for p in item.problems())
        self.built[s.name] = built
        self.resolved[s.name] = {k: dataclasses.asdict(v) for k, v in built.items()}

    def component(self, s: Section) -> None:
        """One component chosen by name or class path, its arguments type-checked by jsonargparse."""
        if s.name not in self.cfg:
            return
        value = resolve_component(self.cfg[s.name], s.name, s.registry, self.host, self.problems)
        if value is not None:
            built = self.built[s.name] = check_with_parser(s.name, s.type, value, self.problems)
            self.resolved[s.name] = with_defaults(value) if built is not None else value

    def component_list(self, s: Section) -> None:
        """A non-empty list of components, each checked as :meth:`component` under ``NAME[i]``."""
        raw = self.cfg.get(s.name, [])
        if s.name in self.cfg and (not isinstance(raw, list) or not raw):
            self.problems.append(f"{s.name}: expected a non-empty list of {s.registry} sources")
            raw = []
        built: list[Component] = []
        resolved: list[Any] = []
        self.built[s.name], self.resolved[s.name] = built, resolved
        for i, item in enumerate(raw):
            value = resolve_component(item, f"{s.name}[{i}]", s.registry, self.host, self.problems)
            if value is not None:
                got = check_with_parser(s.name, s.option_type(), [value], self.problems, where=f"{s.name}[{i}]")
                resolved.append(value if got is None else with_defaults(value))
                built.extend(got or [])

    def factory(self, s: Section) -> None:
        """A callable built by jsonargparse from a class path and arguments (``None`` when optional and absent)."""
        self.built[s.name] = None
        if s.name in self.cfg and not (s.optional and self.cfg[s.name] is None):
            self.resolved[s.name] = self.cfg[s.name]
            self.built[s.name] = check_with_parser(s.name, s.type, self.cfg[s.name], self.problems)

    def mapping(self, s: Section) -> None:
        """``reward_weights``: reward name -> number (checked against the rewards once they are built)."""
        weights = self.cfg.get(s.name, {}) or {}
        if not isinstance(weights, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in weights.values()
        ):
            self.problems.append(f"{s.name}: expected a mapping of reward name to number, got {short_repr(weights)}")
            weights = {}
        self.built[s.name] = weights

    def eval(self, s: Section) -> None:
        """The optional ``eval`` section (:func:`rlpost.engine.evaluation.validate_eval`)."""
        self.built[s.name] = None
        if self.cfg.get(s.name) is not None:
            train_rewards = self.resolved.get("rewards", [])
            checks = _Components(self.host)
            got = validate_eval(self.cfg[s.name], train_rewards, self.built, checks, self.problems)
            self.built[s.name], self.resolved[s.name] = got


class _Components:
    """The recipe's component checks for the ``eval`` section (:class:`rlpost.engine.evaluation.ComponentChecks`):
    names resolved and arguments type-checked exactly as in the training sections."""

    def __init__(self, host: Registries) -> None:
        self.host = host

    def resolve(self, value: Any, where: str, kind: str, problems: list[str]) -> Any:
        """:func:`~rlpost.engine.recipe.names.resolve_component` with this recipe's registries."""
        return resolve_component(value, where, kind, self.host, problems)

    def check(self, key: str, typ: Any, value: Any, problems: list[str], where: str) -> Any:
        """:func:`~rlpost.engine.recipe.typecheck.check_with_parser`."""
        return check_with_parser(key, typ, value, problems, where=where)


def _without_folded(cls: type, resolved: dict[str, Any]) -> dict[str, Any]:
    """``resolved`` without the deprecated aliases (``cls.DEPRECATED``) the settings class folded into their new
    names (they are ``None`` then), so a run's ``recipe.yaml`` uses the new names only."""
    deprecated = getattr(cls, "DEPRECATED", {})
    return {k: v for k, v in resolved.items() if not (k in deprecated and v is None)}


def _range_problems(cfg: dict[str, Any], built: dict[str, Any]) -> list[str]:
    """Each config section's own ``problems()`` (prefixed with its section name) for the sections that type-checked,
    then the checks that need two sections: distributed against run and ema, and the torch optimizer's arguments."""
    problems = [
        f"{s.name}.{p}"
        for s in SECTIONS
        if s.kind == "config" and built.get(s.name) is not None
        for p in built[s.name].problems()
    ]
    if built.get("distributed") is not None and built.get("run") is not None:
        ema = cfg.get("ema") is not None
        problems.extend(validate_distributed(built["distributed"], built["run"].groups_per_step, ema=ema))
    if built.get("torch_optimizer") is not None:
        problems.extend(
            _optimizer_checks(cfg["torch_optimizer"], built["torch_optimizer"], cfg.get("lr_scheduler"), built)
        )
    return problems


def _check_rewards(names: list[str], weights: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        problems.append(f"rewards: reward source(s) {dupes} listed twice")
    for name, weight in weights.items():
        if name not in names:
            problems.append(f"reward_weights.{name}: names no reward in 'rewards'{suggest(name, names)}")
        elif not math.isfinite(weight):
            problems.append(f"reward_weights.{name}: must be a finite number, got {weight}")
        elif weight < 0:
            problems.append(f"reward_weights.{name}: negative weight {weight} (use a reward that scores the opposite)")
    if names and all(float(weights.get(n, 1.0)) == 0.0 for n in names):
        problems.append("reward_weights: all weights are zero; at least one reward must count")
    return problems


def capability_problems(recipe: Recipe) -> list[str]:
    """The advantage estimator's and the update rule's ``requires`` against the sampler's ``provides``
    (:mod:`rlpost.core.api.capabilities`), each missing capability named with both components."""
    sampler, provided = recipe.sampler, recipe.sampler.provides
    problems = []
    for section, component in (("advantage", recipe.advantage), ("optimizer", recipe.optimizer)):
        for capability in missing_capabilities(provided, component.requires):
            problems.append(
                f"{section}: {component.name!r} requires the capability {capability!r}, which sampler "
                f"{sampler.name!r} does not provide (it provides {sorted(provided) or 'nothing'}); "
                "see docs/writing_plugins.md, 'Capabilities'"
            )
    return problems


def _cross_checks(recipe: Recipe, sane_run: bool = True) -> list[str]:
    problems = capability_problems(recipe)
    problems.extend(copies_problems(recipe.copies, recipe.optimizer.required_copies(), recipe.optimizer.name))
    problems.extend(acceleration_problems(recipe.run.speedups, recipe.model))
    if problems or not sane_run:
        return problems  # the component checks below assume a sane run section
    components: list[Component] = [recipe.model, recipe.prompts, recipe.sampler, *recipe.rewards]
    for component in components:
        problems.extend(component.validate(recipe))
    sampler_problems = any(p.startswith("sampler.") for p in problems)
    # The advantage estimator and the update rule may consult the sampler (recipe.counts(), its window law): with a
    # setting the sampler refused, that would raise instead of report. Their own arguments were range-checked when
    # they were constructed.
    for component in () if sampler_problems else (recipe.advantage, recipe.optimizer):
        problems.extend(component.validate(recipe))
    problems.extend(media_problems(recipe.model, [(f"rewards[{i}]", r) for i, r in enumerate(recipe.rewards)]))
    if recipe.eval is not None:  # evaluation components report under their own fields
        problems.extend(component_problems(recipe.eval, recipe))
    return problems


def _optimizer_checks(raw: Any, factory: OptimizerFactory, raw_scheduler: Any, built: dict[str, Any]) -> list[str]:
    """Check the learning rate, then build ``torch.optim`` optimizers (and schedulers) on a one-element probe
    parameter so torch's own argument checks (betas, eps, weight decay, ...) fail here instead of after the model
    loaded. Other optimizer classes are not built: their constructors may need an accelerator or compile kernels."""
    class_path = raw.get("class_path") if isinstance(raw, dict) else raw
    init = (raw.get("init_args") or {}) if isinstance(raw, dict) else {}
    lr = init.get("lr") if isinstance(init, dict) else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not (math.isfinite(lr) and lr > 0):
        return [f"torch_optimizer.init_args.lr: must be a positive finite number, got {lr}"]
    if not (isinstance(class_path, str) and class_path.startswith("torch.optim.")):
        return []
    probe = torch.nn.Parameter(torch.zeros(1))
    try:
        optimizer = factory([probe])
    except Exception as exc:  # noqa: BLE001 - torch raises ValueError/TypeError/RuntimeError for bad arguments
        return [f"torch_optimizer: {class_path} rejects its arguments: {_one_line(exc)}"]
    problems = []
    for group in optimizer.param_groups:
        value = float(group.get("lr", 1.0))
        if not (math.isfinite(value) and value > 0):
            problems.append(f"torch_optimizer.init_args.lr: must be a positive finite number, got {value}")
            break
    scheduler_path = raw_scheduler.get("class_path") if isinstance(raw_scheduler, dict) else raw_scheduler
    factory_s = built.get("lr_scheduler")
    run_length = is_run_length_lr(scheduler_path)  # its constructor's messages already name the field
    if not problems and factory_s is not None and (run_length or str(scheduler_path).startswith("torch.optim.")):
        try:
            factory_s(optimizer)
        except Exception as exc:  # noqa: BLE001 - as above
            text = _one_line(exc)
            problems.append(text if run_length else f"lr_scheduler: {scheduler_path} rejects its arguments: {text}")
    return problems


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
