"""Recipes: YAML files (with overlays and ``--a.b value`` overrides) that choose and configure every component.

A recipe has these top-level keys (one :class:`Section` each in :data:`SECTIONS`, the table that validation, the
command-line parser, name resolution and the resume checks are driven by)::

    run:             RunConfig (seed, output_dir, steps, groups per step, ...)
    model:           a Policy          (e.g. class_path: sd3)
    prompts:         a PromptSource    (e.g. class_path: prompt-file)
    sampler:         a Sampler         (e.g. class_path: tree)
    rewards:         a list of RewardSource
    reward_weights:  {reward name: weight}, default 1.0 each
    advantage:       an AdvantageEstimator
    optimizer:       a PolicyOptimizer (the policy-update rule, e.g. class_path: clipped-surrogate)
    torch_optimizer: a torch optimizer factory (class_path: torch.optim.AdamW, init_args: {lr: ...})
    lr_scheduler:    optional LR scheduler factory
    checkpoint:      {every, keep_last, at_end}                       (rlpost.engine.checkpoint.CheckpointConfig)
    eval:            {prompts|sets, rewards, judges, alarm, num_steps, ...}  (rlpost.engine.evaluation; optional)
    logging:         {tensorboard, wandb, wandb_project, grid_every}  (rlpost.engine.logging_.LoggingConfig)
    guards:          {on_nonfinite: stop|skip, max_skipped_steps}     (rlpost.engine.guards.GuardConfig)
    ema:             {decay, update_every}                            (rlpost.engine.ema.EMAConfig; optional)
    distributed:     {backend, zero_stage, deepspeed_config, bf16}    (rlpost.engine.distributed; optional, ZeRO)

Components are chosen by their registered short name (``tree``), their class name, or a dotted ``class_path``,
with arguments in ``init_args`` (``{class_path: tree, k: 3}`` is accepted as shorthand). Swapping one component is
a one-line overlay. Validation (:func:`validate`) reports **all** problems at once, each naming its field, before any
model is loaded: jsonargparse checks types and argument names per component, then cross-component checks run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import yaml
from jsonargparse import ArgumentParser, Namespace, set_loader
from jsonargparse._actions import ActionConfigFile  # documented as jsonargparse.ActionConfigFile, not re-exported

from rlpost.core.api import (
    AdvantageEstimator,
    Component,
    Policy,
    PolicyOptimizer,
    PromptSource,
    RewardSource,
    Sampler,
    StepCounts,
)
from rlpost.core.registry import ContestedComponentError, Registries, suggest
from rlpost.core.yaml_limits import MAX_BYTES as MAX_YAML_BYTES
from rlpost.core.yaml_limits import YamlLimitError, load_yaml, short_repr
from rlpost.engine.alarm import AlarmConfig
from rlpost.engine.checkpoint import CheckpointConfig
from rlpost.engine.distributed import DistributedConfig, validate_distributed
from rlpost.engine.ema import EMAConfig
from rlpost.engine.evaluation import JUDGE, SET_NAME_RE, EvalSettings, EvalSpec
from rlpost.engine.guards import GuardConfig
from rlpost.engine.logging_ import LoggingConfig

__all__ = [
    "COMPONENT_KEYS",
    "Recipe",
    "RecipeError",
    "RunConfig",
    "build_parser",
    "load_recipe",
    "merge_sources",
    "parse_recipe_args",
    "state_breaking_changes",
    "validate",
    "with_defaults",
]

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass
class RunConfig:
    """Run-level settings.

    Attributes:
        seed: Root seed in ``[0, 2**32 - 1]``; every RNG stream (prompt order, initial noise, SDE noise, minibatches)
            derives from it.
        output_dir: Run directory. The resolved recipe and versions are written there and never overwritten.
        max_steps: Number of training steps (rollout -> rewards -> advantages -> update).
        groups_per_step: Prompt groups (unique prompt draws) per step, across all ranks.
        samples_per_group: Images per group for chain samplers (the GRPO group size); tree samplers derive their
            leaf count from their shape instead.
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N`` (validation checks the
            device exists on this host).
        max_grad_norm: Gradient-norm clip (positive, finite) applied at every optimizer step; null disables it.
        progress: Show the rich progress bar and summary table (main process only).
        log_every: Write metrics to ``metrics.jsonl`` every N steps.
        min_group_spread: Skip a prompt whose previous group's rewards had a standard deviation below this (the
            batch is filled from the next prompts, so a step's budget is unchanged; logs ``prompts/skipped``);
            null (the default) takes every prompt. See :mod:`rlpost.components.prompt_selection`.
        max_skips: With ``min_group_spread``: a low-spread prompt is skipped at most this many epochs in a row.
    """

    seed: int = 0
    output_dir: str = "runs/rlpost"
    max_steps: int = 10
    groups_per_step: int = 2
    samples_per_group: int = 4
    device: str = "auto"
    max_grad_norm: float | None = 1.0
    progress: bool = True
    log_every: int = 1
    min_group_spread: float | None = None
    max_skips: int = 2

    SEED_MAX: ClassVar[int] = 2**32 - 1
    """Largest seed: the RNG streams derive ``seed * 1_000_003 + offset`` seeds and numpy takes 32-bit seeds."""

    def problems(self) -> list[str]:
        """Range problems of these settings, each naming its field relative to the section (the recipe prefixes
        ``run.``; empty when the section is sane)."""
        problems = []
        for name in ("max_steps", "groups_per_step", "samples_per_group", "log_every", "max_skips"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed <= self.SEED_MAX:
            problems.append(f"seed: must be in [0, {self.SEED_MAX}], got {self.seed}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            problems.append(f"max_grad_norm: must be a positive finite number or null, got {self.max_grad_norm}")
        if self.min_group_spread is not None and not (
            math.isfinite(self.min_group_spread) and self.min_group_spread > 0
        ):
            problems.append(f"min_group_spread: must be a positive finite number or null, got {self.min_group_spread}")
        device = device_problem(self.device)
        if device is not None:
            problems.append(f"device: {device}")
        return problems


def device_problem(spec: str) -> str | None:
    """Why ``spec`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``, ``xpu[:N]``) names no usable device on this host,
    or ``None``. Cheap: counts devices without initialising a CUDA context."""
    if spec == "auto":
        return None
    try:
        device = torch.device(spec)
    except RuntimeError:
        return f"{spec!r} is not a device; use auto, cpu, cuda, cuda:N, mps or xpu"
    if device.type == "cpu":
        return None if device.index in (None, 0) else f"{spec!r}: use 'cpu' (there is one CPU device)"
    if device.type == "mps":
        return None if torch.backends.mps.is_available() else f"{spec!r}: MPS is not available on this host"
    if device.type not in ("cuda", "xpu"):
        return f"{spec!r}: rlpost trains on auto, cpu, cuda, cuda:N, mps or xpu, not {device.type!r}"
    backend = getattr(torch, device.type)
    count = backend.device_count() if backend.is_available() else 0
    if count == 0:
        return f"{spec!r}: no {device.type.upper()} device on this host (use auto or cpu)"
    if device.index is not None and device.index >= count:
        return f"{spec!r}: this host has {count} {device.type.upper()} device(s) ({device.type}:0..{count - 1})"
    return None


SectionKind = Literal["config", "component", "component-list", "component-mapping", "factory", "mapping", "eval"]


@dataclass(frozen=True)
class Section:
    """One recipe key: what it holds and how it is parsed, validated and compared on resume.

    Attributes:
        name: The key (``sampler``), or the sub-key within ``eval`` (:data:`EVAL_SECTIONS`).
        kind: ``config`` (a dataclass with a ``problems()`` method; absent = its defaults unless ``optional``),
            ``component`` / ``component-list`` / ``component-mapping`` (one / a list / a name->item mapping of
            ``type`` chosen by registered name from the ``registry`` kind), ``factory`` (a callable built by
            jsonargparse from a class path: the torch optimizer and scheduler), ``mapping`` (plain data of ``type``)
            or ``eval`` (the held-out evaluation section, :data:`EVAL_SECTIONS` plus :class:`EvalSettings`).
        type: Config class, component base class, factory callable type or mapping type.
        registry: Plugin registry kind that resolves short component names.
        required: The recipe must give it.
        optional: Absent or null means ``None`` (not the defaults): the feature is off.
        state: ``whole`` / ``class``: changing the section (compared whole / by class_path) between a checkpoint and
            a resume breaks the saved state, so the resume is refused.
        help: Command-line help.
    """

    name: str
    kind: SectionKind
    type: Any
    registry: str = ""
    required: bool = False
    optional: bool = False
    state: Literal["", "whole", "class"] = ""
    help: str = ""


# The recipe's sections, in validation order (which is also the order of the saved recipe.yaml).
SECTIONS: tuple[Section, ...] = (
    Section("run", "config", RunConfig, help="run settings"),
    Section("model", "component", Policy, "model", required=True, state="whole", help="the model component"),
    Section("prompts", "component", PromptSource, "prompts", required=True, help="the prompts component"),
    Section("sampler", "component", Sampler, "sampler", required=True, state="class", help="the sampler component"),
    Section(
        "advantage", "component", AdvantageEstimator, "advantage", True, state="class", help="the advantage component"
    ),
    Section(
        "optimizer", "component", PolicyOptimizer, "optimizer", True, state="class", help="the optimizer component"
    ),
    Section("rewards", "component-list", RewardSource, "reward", required=True, help="reward sources"),
    Section(
        "torch_optimizer", "factory", OptimizerFactory, required=True, state="class", help="torch optimizer factory"
    ),
    Section("lr_scheduler", "factory", SchedulerFactory, optional=True, state="class", help="LR scheduler factory"),
    Section("checkpoint", "config", CheckpointConfig, help="checkpoint interval and rotation"),
    Section("logging", "config", LoggingConfig, help="trackers and sample grids"),
    Section("guards", "config", GuardConfig, help="non-finite policy"),
    Section("ema", "config", EMAConfig, optional=True, help="EMA of the trainable weights"),
    Section("distributed", "config", DistributedConfig, optional=True, help="DeepSpeed ZeRO settings"),
    Section(
        "eval",
        "eval",
        EvalSettings,
        optional=True,
        help="held-out evaluation (optional section): eval.prompts or eval.sets, rewards, judges and settings",
    ),
    Section("reward_weights", "mapping", dict[str, float], help="weight per reward name"),
)
SECTION = {s.name: s for s in SECTIONS}
# The components of the ``eval`` section (its other keys are :class:`EvalSettings`).
EVAL_SECTIONS: tuple[Section, ...] = (
    Section("prompts", "component", PromptSource, "prompts", help="held-out prompt source"),
    Section("sets", "component-mapping", PromptSource, "prompts", help="named held-out prompt sources"),
    Section("rewards", "component-list", RewardSource, "reward", help="evaluation rewards (default: training)"),
    Section("judges", "component-list", RewardSource, "reward", help="second judges, never training rewards"),
)
COMPONENT_KEYS: dict[str, tuple[type[Component], str]] = {
    s.name: (s.type, s.registry) for s in SECTIONS if s.kind == "component"
}
"""Single-component sections: key -> (base class, registry kind)."""


# What an error message may print: a hostile recipe must not turn into a multi-megabyte message.
MAX_PROBLEM_CHARS = 1000
MAX_PROBLEMS_SHOWN = 50


class RecipeError(Exception):
    """A recipe failed validation; ``problems`` lists every problem, each naming its field.

    The message shows at most :data:`MAX_PROBLEMS_SHOWN` problems of at most :data:`MAX_PROBLEM_CHARS` characters
    each (``problems`` keeps them all).
    """

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = [_clip(p, MAX_PROBLEM_CHARS) for p in self.problems[:MAX_PROBLEMS_SHOWN]]
        hidden = len(self.problems) - len(shown)
        if hidden:
            shown.append(f"... and {hidden} more problem(s)")
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in shown))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 30]}... ({len(text)} characters in all)"


@dataclass
class Recipe:
    """A validated recipe with instantiated (not yet set-up) components.

    Attributes:
        run: Run settings.
        model: The policy adapter (weights load in ``setup``).
        prompts: Prompt source.
        sampler: Sampler.
        rewards: Reward sources.
        reward_weights: Weight per reward name.
        advantage: Advantage estimator.
        optimizer: Policy-update rule.
        torch_optimizer: Factory building the torch optimizer from the trainable parameters.
        lr_scheduler: Optional factory building an LR scheduler from the torch optimizer.
        config: The resolved recipe as plain data (what is written to the run directory).
        checkpoint: Checkpoint interval and rotation.
        logging: Optional trackers and sample grids.
        guards: Non-finite policy.
        eval: Held-out evaluation, or ``None``.
        ema: EMA of the trainable weights, or ``None``.
        distributed: DeepSpeed ZeRO across ranks, or ``None`` (one process, plain torch backend).
    """

    run: RunConfig
    model: Policy
    prompts: PromptSource
    sampler: Sampler
    rewards: list[RewardSource]
    reward_weights: dict[str, float]
    advantage: AdvantageEstimator
    optimizer: PolicyOptimizer
    torch_optimizer: OptimizerFactory
    lr_scheduler: SchedulerFactory | None
    config: dict[str, Any] = field(default_factory=dict)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    guards: GuardConfig = field(default_factory=GuardConfig)
    eval: EvalSpec | None = None
    ema: EMAConfig | None = None
    distributed: DistributedConfig | None = None

    def counts(self) -> StepCounts:
        """Closed-form per-step counts from the sampler for this recipe's batch shape."""
        return self.sampler.counts(self.run.groups_per_step, self.run.samples_per_group)

    def derived(self) -> dict[str, int]:
        """Derived quantities printed at start-up (never configured directly)."""
        c = self.counts()
        return {
            "groups per step": self.run.groups_per_step,
            "images per step": c.images,
            "trainable edges per step": c.trainable_edges,
            "NFE per step (rollout)": c.rollout_forwards,
            "NFE per step (training, fwd+bwd)": c.train_forwards,
        }


# ------------------------------------------------------------------------------------------------ loading


def _deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Merge ``overlay`` into ``base``. A component whose ``class_path`` changes is replaced, not merged, so an
    overlay swapping the sampler does not inherit the old sampler's arguments."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            swapped = "class_path" in value and old.get("class_path") != value["class_path"]
            out[key] = copy.deepcopy(value) if swapped else _deep_merge(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_yaml(path: str) -> dict[str, Any]:
    """Read one recipe file with the limits of :mod:`rlpost.core.yaml_limits` (size, nesting, alias expansion)."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError([f"recipe file not found: {path}"])
    try:
        if p.stat().st_size > MAX_YAML_BYTES:  # refuse before reading: the file may be huge
            raise RecipeError([f"{path}: not valid YAML: larger than {MAX_YAML_BYTES} bytes, the limit for a recipe"])
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError([f"{path}: not valid YAML: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    except OSError as exc:
        raise RecipeError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    try:
        data = load_yaml(text, path)
    except yaml.YAMLError as exc:
        raise RecipeError([f"{path}: not valid YAML: {_clip(str(exc), MAX_PROBLEM_CHARS)}"]) from None
    problem = _string_beyond_limits(data)
    if problem is not None:
        raise RecipeError([f"{path}: {problem}"])
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}"])
    return data


def _string_beyond_limits(data: Any, where: str = "") -> str | None:
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
        problem = _string_beyond_limits(value, key)
        if problem is not None:
            return problem
    return None


def _set_path(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in ``cfg``; for components, ``sampler.k`` means ``sampler.init_args.k``."""
    parts = dotted.split(".")
    node = cfg
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
        is_component = i == 0 and parts[0] in COMPONENT_KEYS
        if is_component and parts[1] not in ("class_path", "init_args"):
            node = node.setdefault("init_args", {})
    leaf = parts[-1]
    if len(parts) == 1 and parts[0] in COMPONENT_KEYS and isinstance(value, str):
        value = {"class_path": value}
    if leaf == "class_path" and node.get("class_path") not in (None, value):
        node.pop("init_args", None)  # switching class: the old arguments do not apply
    node[leaf] = value


def merge_sources(recipes: Sequence[str], overrides: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Merge recipe files (later ones overlay earlier ones) and ``--a.b value`` overrides (values parsed as YAML).

    Raises:
        RecipeError: If a file is missing or not a YAML mapping, or a file or override exceeds a YAML limit (size,
            nesting, alias expansion; see :mod:`rlpost.core.yaml_limits`).
    """
    cfg: dict[str, Any] = {}
    for path in recipes:
        cfg = _deep_merge(cfg, _read_yaml(path))
    for dotted, raw in overrides:
        try:
            value = load_yaml(raw, f"--{dotted}")
        except YamlLimitError as exc:
            raise RecipeError([f"--{dotted}: not valid YAML: {exc}"]) from None
        except yaml.YAMLError:
            value = raw  # not YAML: the plain string
        _set_path(cfg, dotted, value)
    return cfg


# ------------------------------------------------------------------------------------------- name resolution


def _resolve_component(value: Any, field_name: str, kind: str, host: Registries, problems: list[str]) -> Any:
    """Translate a registered short name into a dotted class_path; flatten ``{class_path, k: v}`` shorthand."""
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, dict):
        problems.append(
            f"{field_name}: expected a component ({{class_path: ..., init_args: ...}}), got {short_repr(value)}"
        )
        return None
    value = dict(value)
    extra = {k: value.pop(k) for k in list(value) if k not in ("class_path", "init_args", "dict_kwargs")}
    if extra:
        value["init_args"] = {**value.get("init_args", {}), **extra}
    class_path = value.get("class_path")
    if not isinstance(class_path, str):
        problems.append(f"{field_name}.class_path: missing; choose one of {host.registry(kind).names()}")
        return None
    registry = host.registry(kind)
    try:
        entry = registry.get(class_path)
    except ContestedComponentError as exc:  # two distributions claim the name: never pick one silently
        problems.append(f"{field_name}.class_path: {exc}")
        return None
    except KeyError as exc:
        if ":" in class_path:  # a qualified dist:name that does not exist
            problems.append(f"{field_name}.class_path: {exc.args[0]}")
            return None
        entry = None
    if entry is not None:
        value["class_path"] = entry.class_path
    elif "." not in class_path:
        by_class = [e for e in registry.entries() if e.cls.__name__ == class_path]
        if by_class:
            value["class_path"] = by_class[0].class_path
        else:
            problems.append(
                f"{field_name}.class_path: unknown {kind} {short_repr(class_path)}"
                f"{suggest(class_path, registry.names())} "
                f"(available: {', '.join(registry.names()) or 'none'})"
            )
            return None
    return value


def _check_with_parser(key: str, typ: Any, value: Any, problems: list[str], where: str | None = None) -> Any:
    """Type-check one section with jsonargparse; on failure record the message prefixed with the field name
    (``where``, default ``key``). An unknown option is reported under its full field path with the nearest name."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument(f"--{key}", type=typ)
    try:
        ns = parser.parse_object({key: value})
        return parser.instantiate_classes(ns)[key]
    except Exception as exc:  # noqa: BLE001 - jsonargparse raises several types; all are recipe problems
        where = where or key
        problems.append(_unknown_option_problem(where, typ, value, str(exc)) or f"{where}: {_clean(str(exc), key)}")
        return None


def _check_named(key: str, field_name: str, typ: Any, value: Any, problems: list[str]) -> Any:
    """:func:`_check_with_parser` under a plain key, reporting problems under the dotted ``field_name``."""
    return _check_with_parser(key, typ, value, problems, where=field_name)


_UNKNOWN_OPTION = re.compile(r"Option '([^']+)' is not accepted|does not accept option '([^']+)'")


def _unknown_option_problem(where: str, typ: Any, value: Any, message: str) -> str | None:
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


def _init_signature(class_path: str) -> list[inspect.Parameter]:
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
    """Constructor parameter names of ``class_path`` (see :func:`_init_signature`)."""
    return [p.name for p in _init_signature(class_path)]


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
    for param in _init_signature(value["class_path"]):
        if param.name in init or param.default is inspect.Parameter.empty:
            continue
        default = _plain_default(param.default)
        if default is not _NO_DEFAULT:
            init[param.name] = default
    return {**value, "init_args": init} if init else value


def _clean(message: str, key: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    text = " ".join(lines)
    return text.replace(f'Parser key "{key}":', "").strip()


def validate(cfg: dict[str, Any], host: Registries) -> Recipe:
    """Validate a merged recipe and instantiate its components (no weights are loaded).

    Each section in :data:`SECTIONS` is type-checked by its kind; the range problems of the config sections (their
    ``problems()``) and the checks across sections follow, then the components' own checks.

    Args:
        cfg: The merged recipe as plain data.
        host: Where component names resolve: the component registries (the plugin host provides them).

    Raises:
        RecipeError: Listing every problem found, each naming the offending field.
    """
    problems = [f"{key}: unknown top-level key{suggest(key, list(SECTION))}" for key in cfg if key not in SECTION]
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


class _SectionChecks:
    """Type-checks one recipe section per :meth:`check` call, by its :attr:`Section.kind`, into
    ``built`` (the instantiated section, ``None`` when an optional one is off) and ``resolved`` (its plain data with
    registered names resolved and defaults filled in), recording problems."""

    def __init__(self, cfg: dict[str, Any], host: Registries, problems: list[str]) -> None:
        self.cfg, self.host, self.problems = cfg, host, problems
        self.built: dict[str, Any] = {}
        self.resolved: dict[str, Any] = {}

    def check(self, s: Section) -> None:
        """Check the top-level section ``s`` by its kind."""
        by_kind = {
            "config": self.config,
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
            built = self.built[s.name] = _check_with_parser(s.name, s.type, raw or {}, self.problems)
            self.resolved[s.name] = dataclasses.asdict(built) if built is not None else raw

    def component(self, s: Section) -> None:
        """One component chosen by name or class path, its arguments type-checked by jsonargparse."""
        if s.name not in self.cfg:
            return
        value = _resolve_component(self.cfg[s.name], s.name, s.registry, self.host, self.problems)
        if value is not None:
            built = self.built[s.name] = _check_with_parser(s.name, s.type, value, self.problems)
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
            value = _resolve_component(item, f"{s.name}[{i}]", s.registry, self.host, self.problems)
            if value is not None:
                got = _check_with_parser(s.name, _option_type(s), [value], self.problems, where=f"{s.name}[{i}]")
                resolved.append(value if got is None else with_defaults(value))
                built.extend(got or [])

    def factory(self, s: Section) -> None:
        """A callable built by jsonargparse from a class path and arguments (``None`` when optional and absent)."""
        self.built[s.name] = None
        if s.name in self.cfg and not (s.optional and self.cfg[s.name] is None):
            self.resolved[s.name] = self.cfg[s.name]
            self.built[s.name] = _check_with_parser(s.name, s.type, self.cfg[s.name], self.problems)

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
        """The optional ``eval`` section (:func:`_validate_eval`)."""
        self.built[s.name] = None
        if self.cfg.get(s.name) is not None:
            train_rewards = self.resolved.get("rewards", [])
            got = _validate_eval(self.cfg[s.name], train_rewards, self.built, self.host, self.problems)
            self.built[s.name], self.resolved[s.name] = got


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


def _validate_eval(
    value: Any, train_rewards: list[Any], built: dict[str, Any], host: Registries, problems: list[str]
) -> tuple[EvalSpec | None, Any]:
    """Validate the ``eval`` section: prompt source(s), reward sources (default: the training rewards), second judges
    (never training rewards) and settings."""
    if not isinstance(value, dict):
        problems.append(
            f"eval: expected a mapping (prompts or sets, rewards, judges, num_steps, every, seed, batch_size), got "
            f"{value!r}"
        )
        return None, value
    components = (*(e.name for e in EVAL_SECTIONS), "alarm")
    known = (*components, *(f.name for f in dataclasses.fields(EvalSettings)))
    for key in value:
        if key not in known:
            problems.append(f"eval.{key}: unknown key{suggest(key, list(known))}")
    start = len(problems)
    settings_raw = {k: v for k, v in value.items() if k not in components and k in known}
    settings = _check_with_parser("eval", EvalSettings, settings_raw, problems)
    resolved: dict[str, Any] = {}
    sets = _validate_eval_sets(value, host, problems, resolved)
    rewards_raw = value.get("rewards", train_rewards)
    if not isinstance(rewards_raw, list) or not rewards_raw:
        problems.append("eval.rewards: expected a non-empty list of reward sources")
        rewards_raw = []
    rewards: list[RewardSource] = []
    for i, rv in _resolve_eval_rewards(rewards_raw, "rewards", host, problems, resolved):
        # The same configuration as a training reward shares its instance (its weights load once).
        shared = [r for r, c in zip(built.get("rewards", []), train_rewards, strict=False) if c == rv]
        if shared:
            rewards.append(shared[0])
            continue
        got = _check_named("rewards", f"eval.rewards[{i}]", list[RewardSource], [rv], problems)
        if got is not None:
            rewards.extend(got)
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        problems.append(
            f"eval.rewards: reward source(s) {sorted({n for n in names if names.count(n) > 1})} listed twice"
        )
    judges = _validate_judges(value, built, names, host, problems, resolved)
    trained = [n for n in names if n in {r.name for r in built.get("rewards") or []}]
    alarm = _validate_alarm(value.get("alarm"), trained, problems, resolved)
    if settings is not None:
        resolved.update(dataclasses.asdict(settings))
        problems.extend(f"eval.{p}" for p in settings.problems())
    if len(problems) > start or sets is None or settings is None:
        return None, resolved
    spec = EvalSpec(sets=sets, rewards=rewards, judges=judges, settings=settings, alarm=alarm, trained=trained)
    return spec, resolved


def _validate_alarm(raw: Any, trained: list[str], problems: list[str], resolved: dict[str, Any]) -> AlarmConfig | None:
    """``eval.alarm`` (:mod:`rlpost.engine.alarm`): type and range checks (the config's own ``problems()``); an
    enabled alarm needs a trained reward to watch."""
    if raw is None:
        return None
    alarm: AlarmConfig | None = _check_with_parser("alarm", AlarmConfig, raw, problems, where="eval.alarm")
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


def _validate_eval_sets(
    value: dict[str, Any], host: Registries, problems: list[str], resolved: dict[str, Any]
) -> dict[str, PromptSource] | None:
    """``eval.prompts`` (one source: the unnamed set ``""``) or ``eval.sets`` (named sources), exactly one."""
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
        where = f"eval.sets.{name}" if name else "eval.prompts"
        if name and (not isinstance(name, str) or not SET_NAME_RE.match(name) or name == JUDGE):
            problems.append(
                f"{where}: bad set name {name!r} (letters, digits, '_', '-', '.'; not starting with a symbol; not "
                f"{JUDGE!r})"
            )
            continue
        pv = _resolve_component(item, where, "prompts", host, problems)
        if pv is None:
            continue
        resolved_sets[name] = pv
        got = _check_named("prompts", where, PromptSource, pv, problems)
        if got is not None:
            sets[name] = got
    if "prompts" in value:
        resolved["prompts"] = resolved_sets.get("")
    else:
        resolved["sets"] = resolved_sets
    return sets if len(sets) == len(raw) else None


def _resolve_eval_rewards(
    raw: list[Any], key: str, host: Registries, problems: list[str], resolved: dict[str, Any]
) -> Iterator[tuple[int, Any]]:
    """Resolve each entry of ``eval.<key>`` as a reward component (problems name ``eval.<key>[i]``), record it in
    ``resolved[key]``, and yield ``(i, resolved entry)`` for those that resolve."""
    resolved[key] = []
    for i, item in enumerate(raw):
        value = _resolve_component(item, f"eval.{key}[{i}]", "reward", host, problems)
        if value is not None:
            resolved[key].append(value)
            yield i, value


def _validate_judges(
    value: dict[str, Any],
    built: dict[str, Any],
    eval_reward_names: list[str],
    host: Registries,
    problems: list[str],
    resolved: dict[str, Any],
) -> list[RewardSource]:
    """``eval.judges``: reward sources scored at evaluation only; none may be a training or evaluation reward."""
    raw = value.get("judges", [])
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        problems.append(f"eval.judges: expected a list of reward sources, got {raw!r}")
        return []
    train_names = [r.name for r in built.get("rewards") or []]
    judges: list[RewardSource] = []
    for i, jv in _resolve_eval_rewards(raw, "judges", host, problems, resolved):
        got = _check_named("rewards", f"eval.judges[{i}]", list[RewardSource], [jv], problems)
        if not got:
            continue
        judge = got[0]
        if judge.name in train_names:
            problems.append(
                f"eval.judges[{i}]: {judge.name!r} is a training reward; a judge must be a scorer the policy is not "
                "trained on (list it in eval.rewards instead)"
            )
        elif judge.name in eval_reward_names:
            problems.append(f"eval.judges[{i}]: {judge.name!r} is also in eval.rewards; list it in one place")
        elif judge.name in [j.name for j in judges]:
            problems.append(f"eval.judges[{i}]: {judge.name!r} listed twice")
        judges.append(judge)
    return judges


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


def _cross_checks(recipe: Recipe, sane_run: bool = True) -> list[str]:
    problems: list[str] = []
    missing = recipe.advantage.requires - recipe.sampler.provides
    if missing:
        problems.append(
            f"advantage: {recipe.advantage.name!r} requires {sorted(missing)} from the sampler, but sampler "
            f"{recipe.sampler.name!r} provides {sorted(recipe.sampler.provides) or 'nothing'}"
        )
    if problems or not sane_run:
        return problems  # the component checks below assume a sane run section
    components: list[Component] = [
        recipe.model,
        recipe.prompts,
        recipe.sampler,
        *recipe.rewards,
        recipe.advantage,
        recipe.optimizer,
    ]
    for component in components:
        for problem in component.validate(recipe):
            problems.append(problem)
    if recipe.eval is not None:
        # Evaluation components report under their own field (their validate() names the training field).
        for name, source in recipe.eval.sets.items():
            where = f"eval.sets.{name}" if name else "eval.prompts"
            problems.extend(_refield(p, "prompts", where) for p in source.validate(recipe))
        for i, judge in enumerate(recipe.eval.judges):
            problems.extend(_refield(p, "rewards", f"eval.judges[{i}]") for p in judge.validate(recipe))
    return problems


def _refield(problem: str, field_name: str, where: str) -> str:
    """Re-home a component's problem from the training field it assumes (``prompts...``) to ``where``, including
    the command-line flags it suggests (``--prompts.path`` becomes ``--eval.sets.NAME.path``)."""
    problem = problem.replace(f"--{field_name}.", f"--{where}.")
    for sep in (".", ":", "["):
        if problem.startswith(field_name + sep):
            return where + problem[len(field_name) :]
    return f"{where}: {problem}"


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
    if not problems and factory_s is not None and str(scheduler_path).startswith("torch.optim."):
        try:
            factory_s(optimizer)
        except Exception as exc:  # noqa: BLE001 - as above
            problems.append(f"lr_scheduler: {scheduler_path} rejects its arguments: {_one_line(exc)}")
    return problems


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


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


# ------------------------------------------------------------------------------------------------ parser


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
        data = _resolve_names(data, host, contested_to_registered=True)
    return data


def _contested_sections(doc: dict[str, Any], host: Registries) -> dict[str, list[str]]:
    """Top-level section -> problems, for every component in ``doc`` named by a contested short name."""
    found: dict[str, list[str]] = {}

    def check(value: Any, kind: str, field: str, top: str) -> None:
        name = value if isinstance(value, str) else value.get("class_path") if isinstance(value, dict) else None
        if not isinstance(name, str):
            return
        try:
            host.registry(kind).get(name)
        except ContestedComponentError as exc:
            found.setdefault(top, []).append(f"{field}.class_path: {exc}")
        except KeyError:
            pass  # unknown names: validate() reports them with the nearest name

    def walk(data: dict[str, Any], sections: tuple[Section, ...], prefix: str, top: str | None) -> None:
        for s in sections:
            value, field = data.get(s.name), prefix + s.name
            if s.kind == "component" and s.name in data:
                check(value, s.registry, field, top or s.name)
            elif s.kind == "component-list" and isinstance(value, list):
                for i, item in enumerate(value):
                    check(item, s.registry, f"{field}[{i}]", top or s.name)
            elif s.kind == "component-mapping" and isinstance(value, dict):
                for key, item in value.items():
                    check(item, s.registry, f"{field}.{key}", top or s.name)
            elif s.kind == "eval" and isinstance(value, dict):
                walk(value, EVAL_SECTIONS, f"{field}.", top or s.name)

    walk(doc, SECTIONS, "", None)
    return found


def _refuse_contested(argv: Sequence[str], docs: list[dict[str, Any]], host: Registries) -> None:
    """Refuse a contested component name in a recipe file unless a later file or a later command-line option sets
    its top-level section (the file's choice is then never used, as with any overridden value).

    Raises:
        RecipeError: Naming every claimant and how to choose (a qualified ``distribution:name``, a class path, or
            blocking a plugin).
    """
    positions = [i for i, token in enumerate(argv) if token == "--recipe" or token.startswith("--recipe=")]
    problems: list[str] = []
    for n, (at, doc) in enumerate(zip(positions, docs, strict=False)):
        for section, found in _contested_sections(doc, host).items():
            later_file = any(section in other for other in docs[n + 1 :])
            later_option = any(
                token.split("=")[0] == f"--{section}" or token.startswith(f"--{section}.") for token in argv[at + 1 :]
            )
            if not (later_file or later_option):
                problems += found
    if problems:
        raise RecipeError(problems)


set_loader(RECIPE_PARSER_MODE, _recipe_loader, exceptions=(yaml.YAMLError,))


def _resolve_names(doc: dict[str, Any], host: Registries, contested_to_registered: bool = False) -> dict[str, Any]:
    """``doc`` with the components it names by registered short name or class name given by dotted class path (and
    ``{class_path: x, k: v}`` shorthand moved into ``init_args``). Unknown names are left for :func:`validate` to
    report with its nearest-name suggestion.

    With ``contested_to_registered``, a contested name becomes the class the registry kept (first-party wins), so
    jsonargparse can load a recipe file whose contested section a later file or option replaces;
    :func:`parse_recipe_args` has already refused every contested name that nothing replaces
    (:func:`_contested_sections`)."""

    def one(value: Any, kind: str) -> Any:
        resolved = _resolve_component(value, "", kind, host, [])
        if resolved is None and contested_to_registered:
            name = value if isinstance(value, str) else value.get("class_path") if isinstance(value, dict) else None
            kept = [e for e in host.registry(kind).entries() if e.name == name]
            if kept and host.registry(kind).claims(str(name))[1:]:
                spec = {"class_path": value} if isinstance(value, str) else dict(value)
                resolved = _resolve_component({**spec, "class_path": kept[0].class_path}, "", kind, host, [])
        return value if resolved is None else resolved

    def section(data: dict[str, Any], sections: tuple[Section, ...]) -> dict[str, Any]:
        out = dict(data)
        for s in sections:
            value = out.get(s.name)
            if s.kind == "component" and s.name in out:
                out[s.name] = one(value, s.registry)
            elif s.kind == "component-list" and isinstance(value, list):
                out[s.name] = [one(item, s.registry) for item in value]
            elif s.kind == "component-mapping" and isinstance(value, dict):
                out[s.name] = {name: one(item, s.registry) for name, item in value.items()}
            elif s.kind == "eval" and isinstance(value, dict):
                out[s.name] = section(value, EVAL_SECTIONS)
        return out

    return section(doc, SECTIONS)


# Command-line options that take a component name, and the registry that resolves it.
NAMED_OPTIONS: dict[str, str] = {
    **{s.name: s.registry for s in SECTIONS if s.kind == "component"},
    **{f"eval.{e.name}": e.registry for e in EVAL_SECTIONS if e.kind == "component"},
}
# List and mapping fields whose ``--KEY.help NAME`` names one component (``--KEY NAME`` gives the whole list).
NAMED_HELP_OPTIONS: dict[str, str] = {
    **NAMED_OPTIONS,
    **{s.name: s.registry for s in SECTIONS if s.kind == "component-list"},
    **{f"eval.{e.name}": e.registry for e in EVAL_SECTIONS if e.kind != "component"},
}


def _resolve_argv_names(argv: Sequence[str], host: Registries) -> list[str]:
    """``argv`` with the component named by ``--KEY NAME``, ``--KEY.class_path NAME`` or ``--KEY.help NAME`` given by
    dotted class path (see :func:`_recipe_loader` for why jsonargparse needs that). Only these options are touched;
    every other token is left to jsonargparse.

    Raises:
        RecipeError: If NAME is not a registered name, class name or dotted class path (with the nearest name).
    """
    out = list(argv)
    for i, token in enumerate(out):
        option, eq, value = token.partition("=")
        key = option[2:].removesuffix(".class_path").removesuffix(".help") if option.startswith("--") else ""
        kinds = NAMED_HELP_OPTIONS if option.endswith(".help") else NAMED_OPTIONS
        inline = option == f"--{key}" and key in NAMED_HELP_OPTIONS  # may be given as a YAML mapping or list
        if key not in kinds and not inline:
            continue
        at = i if eq else i + 1
        if not eq:
            if at >= len(out):
                continue  # jsonargparse reports the missing value
            value = out[at]
        if inline and value.lstrip().startswith(("{", "[")):
            resolved_value = _resolve_inline(key, value, host)
            out[at] = f"{option}={resolved_value}" if eq else resolved_value
            continue
        if key not in kinds or "." in value or value.startswith("-"):
            continue  # a class path or the next option: jsonargparse reads it
        problems: list[str] = []
        resolved = _resolve_component(
            value, key + (".help" if option.endswith(".help") else ""), kinds[key], host, problems
        )
        if resolved is None:
            raise RecipeError([p.replace(".help.class_path:", ".help:") for p in problems])
        out[at] = f"{option}={resolved['class_path']}" if eq else resolved["class_path"]
    return out


def _resolve_inline(key: str, value: str, host: Registries) -> str:
    """A YAML mapping or list given for the component field ``key`` (``--rewards '[jpeg-compressibility]'``), with
    its registered names resolved as in a recipe file (:func:`_resolve_names`), as JSON for jsonargparse; ``value``
    itself when it is no YAML (jsonargparse reports that)."""
    try:
        loaded = load_yaml(value, f"--{key}")
    except yaml.YAMLError:
        return value
    doc: dict[str, Any] = {}
    node = doc
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = loaded
    contested = _contested_sections(doc, host)
    if contested:
        raise RecipeError([problem for found in contested.values() for problem in found])
    node = _resolve_names(doc, host)
    for part in parents:
        node = node[part]
    return json.dumps(node[leaf])


def _check_value_limits(argv: Sequence[str]) -> None:
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
            problem = _string_beyond_limits(loaded)
            if problem is not None:
                raise RecipeError([f"{option}: {problem}"])


def _recipe_files(argv: Sequence[str]) -> list[str]:
    """The ``--recipe`` files in ``argv``, in order. They are read with :func:`_read_yaml` before jsonargparse reads
    them, so that a missing, oversize or non-UTF-8 file is refused with its own message before anything else."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    scan.add_argument("--recipe", action="append", default=[])
    return list(scan.parse_known_args(list(argv))[0].recipe)


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
    files = _recipe_files(argv)
    docs = [_read_yaml(path) for path in files]
    bench = [path for path, doc in zip(files, docs, strict=True) if "bench" in doc]
    if bench:  # a bench recipe describes several training recipes, not one
        raise RecipeError(
            [
                f"{bench[0]} is a bench recipe (top-level 'bench:' key); run it with rlpost bench --recipe "
                f"{bench[0]}, or validate/train one of the recipes it benchmarks"
            ]
        )
    _check_value_limits(argv)
    _refuse_contested(argv, docs, host)
    token = _PARSE_HOST.set(host)
    try:
        args = _resolve_argv_names(argv, host)
        if not files and not any(a in ("-h", "--help") or a.split("=")[0].endswith(".help") for a in args):
            raise RecipeError(["give at least one --recipe FILE"])
        try:
            namespace = parser.parse_args(args)
        except argparse.ArgumentError as exc:
            raise RecipeError(_parse_problems(parser, files, args, host, str(exc))) from None
    finally:
        _PARSE_HOST.reset(token)
    return _recipe_from_namespace(parser, namespace), namespace


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
    if match is None:
        unrecognized = re.match(r"\s*[Uu]nrecognized arguments: --([^\s=]+)", message)
        if unrecognized is not None:  # a top-level option that is no recipe field
            name = unrecognized.group(1)
            return f"--{name}: unknown option{suggest(name.split('.')[0], list(SECTION))}", None
        return _clip(" ".join(message.split()), MAX_PROBLEM_CHARS), None
    where = match.group(1)
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
            unknown = _unknown_option_problem(where, cls, {}, message)
        else:
            unknown = _unknown_option_problem(where, None, {"class_path": class_path}, message)
        if unknown is not None:
            return unknown, where
    return f"{where}: {_clean(message, where)}", where


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


def _option_type(s: Section) -> Any:
    """The type jsonargparse checks a section's value against (a list or mapping of components, or ``s.type``)."""
    if s.kind == "component-list":
        return types.GenericAlias(list, (s.type,))
    if s.kind == "component-mapping":
        return types.GenericAlias(dict, (str, s.type))
    return s.type


def _add_arguments(parser: ArgumentParser, s: Section) -> None:
    """The command-line option(s) of one recipe section."""
    if s.kind == "config" and not s.optional:
        parser.add_class_arguments(s.type, s.name)
    elif s.kind == "eval":  # every key optional: the section is off unless it names a prompt source
        group = parser.add_argument_group(s.name, s.help)
        for e in EVAL_SECTIONS:
            group.add_argument(f"--eval.{e.name}", type=_option_type(e) | None, default=None, help=e.help)
        group.add_argument(
            "--eval.alarm", type=AlarmConfig | None, default=None, help="reward-hacking alarm (rlpost.engine.alarm)"
        )
        hints = typing.get_type_hints(EvalSettings)
        for f in dataclasses.fields(EvalSettings):
            help_text = EVAL_SETTING_HELP[f.name]
            group.add_argument(f"--eval.{f.name}", type=hints[f.name], default=f.default, help=help_text)
    elif s.optional:
        parser.add_argument(f"--{s.name}", type=_option_type(s) | None, default=None, help=s.help)
    elif s.kind == "mapping":
        parser.add_argument(f"--{s.name}", type=s.type, default={}, help=s.help)
    else:
        parser.add_argument(f"--{s.name}", type=_option_type(s), help=s.help)


EVAL_SETTING_HELP = {
    "num_steps": "ODE steps (NFE) per evaluation image",
    "every": "evaluate every N training steps, besides step 0 and the last step (0: only those two)",
    "seed": "seed of the evaluation noise (the same images every evaluation)",
    "batch_size": "images per evaluation forward batch",
    "save_images": "per-image PNGs besides the grid",
}


def load_recipe(recipes: Sequence[str], overrides: Sequence[tuple[str, str]], host: Registries) -> Recipe:
    """Merge, validate and instantiate a recipe (see :func:`merge_sources` and :func:`validate`)."""
    return validate(merge_sources(recipes, overrides), host)
