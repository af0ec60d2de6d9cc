"""Recipes: YAML files (with overlays and ``--a.b value`` overrides) that choose and configure every component.

A recipe has these top-level keys::

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
    checkpoint:      {every, keep_last, at_end}                       (rlpost.checkpoint.CheckpointConfig)
    eval:            {prompts|sets, rewards, judges, alarm, num_steps, ...}  (rlpost.evaluation; optional)
    logging:         {tensorboard, wandb, wandb_project, grid_every}  (rlpost.logging_.LoggingConfig)
    guards:          {on_nonfinite: stop|skip, max_skipped_steps}     (rlpost.guards.GuardConfig)
    ema:             {decay, update_every}                            (rlpost.ema.EMAConfig; optional)
    distributed:     {backend, zero_stage, deepspeed_config, bf16}    (rlpost.distributed; optional: DeepSpeed ZeRO)

Components are chosen by their registered short name (``tree``), their class name, or a dotted ``class_path``,
with arguments in ``init_args`` (``{class_path: tree, k: 3}`` is accepted as shorthand). Swapping one component is
a one-line overlay. Validation (:func:`validate`) reports **all** problems at once, each naming its field, before any
model is loaded: jsonargparse checks types and argument names per component, then cross-component checks run.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import inspect
import math
import re
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from jsonargparse import ArgumentParser

from rlpost.alarm import AlarmConfig
from rlpost.api import (
    AdvantageEstimator,
    Component,
    Policy,
    PolicyOptimizer,
    PromptSource,
    RewardSource,
    Sampler,
    StepCounts,
)
from rlpost.checkpoint import CheckpointConfig
from rlpost.distributed import DistributedConfig, validate_distributed
from rlpost.ema import EMAConfig
from rlpost.evaluation import JUDGE, SET_NAME_RE, EvalSettings, EvalSpec
from rlpost.guards import GuardConfig
from rlpost.logging_ import LoggingConfig, missing_tracker_packages
from rlpost.plugins import PluginHost
from rlpost.registry import ContestedComponentError, suggest
from rlpost.yaml_limits import MAX_BYTES as MAX_YAML_BYTES
from rlpost.yaml_limits import YamlLimitError, load_yaml, short_repr

__all__ = [
    "COMPONENT_KEYS",
    "Recipe",
    "RecipeError",
    "RunConfig",
    "build_parser",
    "load_recipe",
    "merge_sources",
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

    SEED_MAX: ClassVar[int] = 2**32 - 1
    """Largest seed: the RNG streams derive ``seed * 1_000_003 + offset`` seeds and numpy takes 32-bit seeds."""

    def problems(self) -> list[str]:
        """Range problems of these settings, each naming its ``run.*`` field (empty when the section is sane)."""
        problems = []
        for name in ("max_steps", "groups_per_step", "samples_per_group", "log_every"):
            if getattr(self, name) < 1:
                problems.append(f"run.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed <= self.SEED_MAX:
            problems.append(f"run.seed: must be in [0, {self.SEED_MAX}], got {self.seed}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            problems.append(f"run.max_grad_norm: must be a positive finite number or null, got {self.max_grad_norm}")
        device = device_problem(self.device)
        if device is not None:
            problems.append(f"run.device: {device}")
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


# Top-level key -> (base class, is_list). ``run``, ``reward_weights``, ``torch_optimizer`` and ``lr_scheduler`` are
# handled separately.
COMPONENT_KEYS: dict[str, tuple[type[Component], str]] = {
    "model": (Policy, "model"),
    "prompts": (PromptSource, "prompts"),
    "sampler": (Sampler, "sampler"),
    "advantage": (AdvantageEstimator, "advantage"),
    "optimizer": (PolicyOptimizer, "optimizer"),
}
LIST_KEYS: dict[str, tuple[type[Component], str]] = {"rewards": (RewardSource, "reward")}
OTHER_KEYS = ("run", "reward_weights", "torch_optimizer", "lr_scheduler")
# Plain-dataclass sections (type-checked by jsonargparse like ``run``); absent = the dataclass defaults.
SETTINGS_KEYS: dict[str, type[Any]] = {
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "guards": GuardConfig,
}
OPTIONAL_KEYS = ("eval", "ema", "distributed")
REQUIRED_KEYS = ("model", "prompts", "sampler", "rewards", "advantage", "optimizer", "torch_optimizer")
ALL_KEYS = (*COMPONENT_KEYS, *LIST_KEYS, *OTHER_KEYS, *SETTINGS_KEYS, *OPTIONAL_KEYS)
# Changing one of these between a checkpoint and a resume breaks the saved state (weights, optimizer or sampler
# state no longer fit): the resume is refused. ``model`` is compared whole, the others by class_path.
STATE_BREAKING_KEYS = ("model",)
STATE_BREAKING_CLASSES = ("sampler", "advantage", "optimizer", "torch_optimizer", "lr_scheduler")


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
    """Read one recipe file with the limits of :mod:`rlpost.yaml_limits` (size, nesting, alias expansion)."""
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
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}"])
    return data


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
            nesting, alias expansion; see :mod:`rlpost.yaml_limits`).
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


def _resolve_component(value: Any, field_name: str, kind: str, host: PluginHost, problems: list[str]) -> Any:
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


def validate(cfg: dict[str, Any], host: PluginHost) -> Recipe:
    """Validate a merged recipe and instantiate its components (no weights are loaded).

    Raises:
        RecipeError: Listing every problem found, each naming the offending field.
    """
    problems: list[str] = []
    for key in cfg:
        if key not in ALL_KEYS:
            problems.append(f"{key}: unknown top-level key{suggest(key, list(ALL_KEYS))}")
    for key in REQUIRED_KEYS:
        if key not in cfg:
            problems.append(f"{key}: missing (required)")
    built: dict[str, Any] = {}
    resolved: dict[str, Any] = {}
    run_value = cfg.get("run", {})
    built["run"] = _check_with_parser("run", RunConfig, run_value, problems)
    resolved["run"] = dataclasses.asdict(built["run"]) if built["run"] is not None else run_value
    # Run-range problems are reported with every other problem; component checks below need a sane run section.
    run_problems = built["run"].problems() if built["run"] is not None else []
    for key, (base, kind) in COMPONENT_KEYS.items():
        if key not in cfg:
            continue
        value = _resolve_component(cfg[key], key, kind, host, problems)
        if value is not None:
            built[key] = _check_with_parser(key, base, value, problems)
            resolved[key] = with_defaults(value) if built[key] is not None else value
    rewards_raw = cfg.get("rewards", [])
    if "rewards" in cfg and (not isinstance(rewards_raw, list) or not rewards_raw):
        problems.append("rewards: expected a non-empty list of reward sources")
        rewards_raw = []
    built["rewards"], resolved["rewards"] = [], []
    for i, item in enumerate(rewards_raw):
        value = _resolve_component(item, f"rewards[{i}]", "reward", host, problems)
        if value is None:
            continue
        reward = _check_with_parser("rewards", list[RewardSource], [value], problems, where=f"rewards[{i}]")
        resolved["rewards"].append(value if reward is None else with_defaults(value))
        if reward is not None:
            built["rewards"].extend(reward)
    if "torch_optimizer" in cfg:
        resolved["torch_optimizer"] = cfg["torch_optimizer"]
        built["torch_optimizer"] = _check_with_parser(
            "torch_optimizer", OptimizerFactory, cfg["torch_optimizer"], problems
        )
    built["lr_scheduler"] = None
    if cfg.get("lr_scheduler") is not None:
        resolved["lr_scheduler"] = cfg["lr_scheduler"]
        built["lr_scheduler"] = _check_with_parser("lr_scheduler", SchedulerFactory, cfg["lr_scheduler"], problems)
    for key, typ in SETTINGS_KEYS.items():
        built[key] = _check_with_parser(key, typ, cfg.get(key) or {}, problems)
        resolved[key] = dataclasses.asdict(built[key]) if built[key] is not None else cfg.get(key)
    built["ema"] = None
    if cfg.get("ema") is not None:
        built["ema"] = _check_with_parser("ema", EMAConfig, cfg["ema"], problems)
        resolved["ema"] = dataclasses.asdict(built["ema"]) if built["ema"] is not None else cfg["ema"]
    built["distributed"] = None
    if cfg.get("distributed") is not None:
        built["distributed"] = _check_with_parser("distributed", DistributedConfig, cfg["distributed"], problems)
        if built["distributed"] is not None:
            resolved["distributed"] = dataclasses.asdict(built["distributed"])
            if built["run"] is not None:
                run_problems.extend(
                    validate_distributed(
                        built["distributed"], built["run"].groups_per_step, ema=cfg.get("ema") is not None
                    )
                )
        else:
            resolved["distributed"] = cfg["distributed"]
    run_problems.extend(_settings_checks(built))
    if built.get("torch_optimizer") is not None:
        run_problems.extend(
            _optimizer_checks(cfg["torch_optimizer"], built["torch_optimizer"], cfg.get("lr_scheduler"), built)
        )
    built["eval"] = None
    if cfg.get("eval") is not None:
        built["eval"], resolved["eval"] = _validate_eval(
            cfg["eval"], resolved.get("rewards", []), built, host, problems
        )
    weights = cfg.get("reward_weights", {}) or {}
    if not isinstance(weights, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in weights.values()
    ):
        problems.append(f"reward_weights: expected a mapping of reward name to number, got {short_repr(weights)}")
        weights = {}
    if problems:
        raise RecipeError(problems + run_problems)
    problems.extend(run_problems)
    reward_names = [r.name for r in built["rewards"]]
    problems.extend(_check_rewards(reward_names, weights))
    full_weights = {name: float(weights.get(name, 1.0)) for name in reward_names}
    resolved["reward_weights"] = full_weights
    recipe = Recipe(
        run=built["run"],
        model=built["model"],
        prompts=built["prompts"],
        sampler=built["sampler"],
        rewards=built["rewards"],
        reward_weights=full_weights,
        advantage=built["advantage"],
        optimizer=built["optimizer"],
        torch_optimizer=built["torch_optimizer"],
        lr_scheduler=built["lr_scheduler"],
        config=resolved,
        checkpoint=built["checkpoint"],
        logging=built["logging"],
        guards=built["guards"],
        eval=built["eval"],
        ema=built["ema"],
        distributed=built["distributed"],
    )
    problems.extend(_cross_checks(recipe, sane_run=not run_problems))
    if problems:
        raise RecipeError(problems)
    return recipe


def _validate_eval(
    value: Any, train_rewards: list[Any], built: dict[str, Any], host: PluginHost, problems: list[str]
) -> tuple[EvalSpec | None, Any]:
    """Validate the ``eval`` section: prompt source(s), reward sources (default: the training rewards), second judges
    (never training rewards) and settings."""
    if not isinstance(value, dict):
        problems.append(
            f"eval: expected a mapping (prompts or sets, rewards, judges, num_steps, every, seed, batch_size), got "
            f"{value!r}"
        )
        return None, value
    components = ("prompts", "sets", "rewards", "judges", "alarm")
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
    resolved["rewards"] = []
    for i, item in enumerate(rewards_raw):
        rv = _resolve_component(item, f"eval.rewards[{i}]", "reward", host, problems)
        if rv is None:
            continue
        resolved["rewards"].append(rv)
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
        for name in ("num_steps", "batch_size"):
            if getattr(settings, name) < 1:
                problems.append(f"eval.{name}: must be >= 1, got {getattr(settings, name)}")
        if settings.every < 0:
            problems.append(f"eval.every: must be >= 0, got {settings.every}")
    if len(problems) > start or sets is None or settings is None:
        return None, resolved
    spec = EvalSpec(sets=sets, rewards=rewards, judges=judges, settings=settings, alarm=alarm, trained=trained)
    return spec, resolved


def _validate_alarm(raw: Any, trained: list[str], problems: list[str], resolved: dict[str, Any]) -> AlarmConfig | None:
    """``eval.alarm`` (:mod:`rlpost.alarm`): type and range checks; an enabled alarm needs a trained reward to watch."""
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
    value: dict[str, Any], host: PluginHost, problems: list[str], resolved: dict[str, Any]
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


def _validate_judges(
    value: dict[str, Any],
    built: dict[str, Any],
    eval_reward_names: list[str],
    host: PluginHost,
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
    resolved["judges"] = []
    for i, item in enumerate(raw):
        jv = _resolve_component(item, f"eval.judges[{i}]", "reward", host, problems)
        if jv is None:
            continue
        resolved["judges"].append(jv)
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
    """Re-home a component's problem from the training field it assumes (``prompts...``) to ``where``."""
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


def _settings_checks(built: dict[str, Any]) -> list[str]:
    """Range checks of the checkpoint/logging/guards/ema sections that type-checked (``built[key]`` not None); each
    settings class checks its own fields (``problems()``)."""
    problems: list[str] = []
    for section in SETTINGS_KEYS:
        obj = built.get(section)
        if obj is not None:
            problems.extend(obj.problems())
    if built.get("logging") is not None:
        problems.extend(missing_tracker_packages(built["logging"]))
    ema = built.get("ema")
    if ema is not None:
        if not 0.0 <= ema.decay < 1.0:
            problems.append(f"ema.decay: must be in [0, 1), got {ema.decay}")
        if ema.update_every < 1:
            problems.append(f"ema.update_every: must be >= 1, got {ema.update_every}")
    return problems


def state_breaking_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Differences between two resolved recipes that make a checkpoint of ``old`` unusable under ``new``."""
    problems = []
    for key in STATE_BREAKING_KEYS:
        # Runs saved before recipe.yaml listed constructor defaults compare equal when only the defaults differ.
        if with_defaults(old.get(key)) != with_defaults(new.get(key)):
            problems.append(f"{key}: changed from {old.get(key)!r} to {new.get(key)!r}")
    for key in STATE_BREAKING_CLASSES:
        a, b = old.get(key) or {}, new.get(key) or {}
        if a.get("class_path") != b.get("class_path"):
            problems.append(f"{key}.class_path: changed from {a.get('class_path')!r} to {b.get('class_path')!r}")
    return problems


# ------------------------------------------------------------------------------------------------ parser


def build_parser(prog: str = "rlpost train") -> ArgumentParser:
    """The jsonargparse parser describing a recipe; used for ``--help`` and ``--print_config``."""
    parser = ArgumentParser(
        prog=prog,
        description="Train with a recipe; every option below can be set in the recipe YAML or as --a.b VALUE.",
        exit_on_error=False,
    )
    parser.add_class_arguments(RunConfig, "run")
    parser.add_class_arguments(CheckpointConfig, "checkpoint")
    parser.add_class_arguments(LoggingConfig, "logging")
    parser.add_class_arguments(GuardConfig, "guards")
    parser.add_argument("--ema", type=EMAConfig | None, default=None, help="EMA of the trainable weights")
    parser.add_argument("--distributed", type=DistributedConfig | None, default=None, help="DeepSpeed ZeRO settings")
    for key, (base, _) in COMPONENT_KEYS.items():
        parser.add_argument(f"--{key}", type=base, help=f"the {key} component")
    parser.add_argument("--rewards", type=list[RewardSource], help="reward sources")
    parser.add_argument("--reward_weights", type=dict[str, float], default={}, help="weight per reward name")
    parser.add_argument("--torch_optimizer", type=OptimizerFactory, help="torch optimizer factory")
    parser.add_argument("--lr_scheduler", type=SchedulerFactory | None, default=None, help="LR scheduler factory")
    evaluation = parser.add_argument_group(
        "eval", "held-out evaluation (optional section): eval.prompts or eval.sets, rewards, judges and settings"
    )
    evaluation.add_argument("--eval.prompts", type=PromptSource | None, default=None, help="held-out prompt source")
    evaluation.add_argument(
        "--eval.sets", type=dict[str, PromptSource] | None, default=None, help="named held-out prompt sources"
    )
    evaluation.add_argument(
        "--eval.rewards", type=list[RewardSource] | None, default=None, help="evaluation rewards (default: training)"
    )
    evaluation.add_argument(
        "--eval.judges", type=list[RewardSource] | None, default=None, help="second judges, never training rewards"
    )
    evaluation.add_argument(
        "--eval.alarm", type=AlarmConfig | None, default=None, help="reward-hacking alarm (rlpost.alarm)"
    )
    hints = typing.get_type_hints(EvalSettings)
    for f in dataclasses.fields(EvalSettings):
        evaluation.add_argument(
            f"--eval.{f.name}", type=hints[f.name], default=f.default, help=EVAL_SETTING_HELP[f.name]
        )
    return parser


EVAL_SETTING_HELP = {
    "num_steps": "ODE steps (NFE) per evaluation image",
    "every": "evaluate every N training steps, besides step 0 and the last step (0: only those two)",
    "seed": "seed of the evaluation noise (the same images every evaluation)",
    "batch_size": "images per evaluation forward batch",
    "save_images": "per-image PNGs besides the grid",
}


def load_recipe(recipes: Sequence[str], overrides: Sequence[tuple[str, str]], host: PluginHost) -> Recipe:
    """Merge, validate and instantiate a recipe (see :func:`merge_sources` and :func:`validate`)."""
    return validate(merge_sources(recipes, overrides), host)
