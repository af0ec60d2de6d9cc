"""The shape of a recipe: its sections (:data:`SECTIONS`, the one table the parser, validation, name resolution and
the resume checks are driven by), the run settings, the validated :class:`Recipe` and :class:`RecipeError`.

A recipe has these top-level keys (one :class:`Section` each)::

    run:             RunConfig (seed, output_dir, steps, groups per step, ...)
    model:           a Policy          (e.g. class_path: sd3)
    prompts:         a PromptSource    (e.g. class_path: prompt-file)
    sampler:         a Sampler         (e.g. class_path: tree)
    rewards:         a list of RewardSource
    reward_weights:  {reward name: weight}, default 1.0 each
    reward_frames:   {reduction: mean|min|first}, a video's per-frame image-reward scores (rlpost.ops.media)
    advantage:       an AdvantageEstimator
    optimizer:       a PolicyOptimizer (the policy-update rule, e.g. class_path: clipped-surrogate)
    torch_optimizer: a torch optimizer factory (class_path: torch.optim.AdamW, init_args: {lr: ...})
    lr_scheduler:    optional LR scheduler factory
    checkpoint:      {every, keep_last, at_end}                       (rlpost.engine.checkpoint.CheckpointConfig)
    eval:            {prompts|sets, rewards, judges, alarm, num_steps, ...}  (rlpost.engine.evaluation; optional)
    logging:         {report_to, project, init_kwargs, grid_every}    (rlpost.engine.logging_.LoggingConfig)
    guards:          {on_nonfinite: stop|skip, max_skipped_steps}     (rlpost.engine.guards.GuardConfig)
    ema:             {decay, update_every}                            (rlpost.engine.ema.EMAConfig; optional)
    copies:          {name: {rate, cap, delay, update_every, offload}} (rlpost.engine.weight_copies; optional)
    distributed:     {backend, zero_stage, deepspeed_config, bf16}    (rlpost.engine.distributed; optional, ZeRO)
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from rlpost.core.api import (
    AdvantageEstimator,
    Component,
    Policy,
    PolicyOptimizer,
    PromptSource,
    RewardSource,
    Sampler,
    StepCounts,
    TrainCounts,
)
from rlpost.engine.checkpoint import CheckpointConfig
from rlpost.engine.distributed import DistributedConfig
from rlpost.engine.ema import EMAConfig
from rlpost.engine.evaluation.config import EvalSettings, EvalSpec
from rlpost.engine.guards import GuardConfig
from rlpost.engine.logging_ import LoggingConfig
from rlpost.engine.weight_copies import CopyConfig
from rlpost.models.acceleration import AccelerateConfig
from rlpost.ops.media import FrameScoring

__all__ = [
    "COMPONENT_KEYS",
    "EVAL_SECTIONS",
    "MAX_PROBLEMS_SHOWN",
    "MAX_PROBLEM_CHARS",
    "SECTION",
    "SECTIONS",
    "OptimizerFactory",
    "Recipe",
    "RecipeError",
    "RunConfig",
    "SchedulerFactory",
    "Section",
    "clip_text",
    "device_problem",
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
        speedups: Opt-in speed-ups (torch.compile, CUDA graphs, attention backend, channels-last VAE, autocast) and
            the ratio guard that refuses a run whose speed-ups change the importance ratio
            (:class:`~rlpost.models.acceleration.AccelerateConfig`, docs/speed.md).
        accelerate: Deprecated name of ``speedups`` (it read as Hugging Face accelerate); still accepted, with a
            ``FutureWarning``.
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
    speedups: AccelerateConfig = field(default_factory=AccelerateConfig)
    accelerate: AccelerateConfig | None = None

    DEPRECATED: ClassVar[dict[str, str]] = {"accelerate": "speedups"}
    """Deprecated field -> its new name; left out of the resolved recipe once folded in."""

    SEED_MAX: ClassVar[int] = 2**32 - 1
    """Largest seed: the RNG streams derive ``seed * 1_000_003 + offset`` seeds and numpy takes 32-bit seeds."""

    def __post_init__(self) -> None:
        """Move settings given under the deprecated ``accelerate`` to ``speedups`` (with a ``FutureWarning``)."""
        if self.accelerate is None:
            return
        warnings.warn("run.accelerate is deprecated; use run.speedups", FutureWarning, stacklevel=3)
        if self.speedups == AccelerateConfig():
            self.speedups, self.accelerate = self.accelerate, None

    def problems(self) -> list[str]:
        """Range problems of these settings, each naming its field relative to the section (the recipe prefixes
        ``run.``; empty when the section is sane)."""
        problems = []
        if self.accelerate is not None:
            problems.append("accelerate: the deprecated name of run.speedups, given beside it; give only run.speedups")
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
        return problems + self.speedups.problems(self.device)


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


SectionKind = Literal[
    "config", "config-mapping", "component", "component-list", "component-mapping", "factory", "mapping", "eval"
]


@dataclass(frozen=True)
class Section:
    """One recipe key: what it holds and how it is parsed, validated and compared on resume.

    Attributes:
        name: The key (``sampler``), or the sub-key within ``eval`` (:data:`EVAL_SECTIONS`).
        kind: ``config`` (a dataclass with a ``problems()`` method; absent = its defaults unless ``optional``),
            ``config-mapping`` (name -> such a dataclass: the weight ``copies``),
            ``component`` / ``component-list`` / ``component-mapping`` (one / a list / a name->item mapping of
            ``type`` chosen by registered name from the ``registry`` kind), ``factory`` (a callable built by
            jsonargparse from a class path: the torch optimizer and scheduler), ``mapping`` (plain data of ``type``)
            or ``eval`` (the held-out evaluation section, :data:`EVAL_SECTIONS` plus
            :class:`~rlpost.engine.evaluation.EvalSettings`).
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

    def option_type(self) -> Any:
        """The type jsonargparse checks the section's value against (a list or mapping of components, or ``type``)."""
        if self.kind == "component-list":
            return types.GenericAlias(list, (self.type,))
        if self.kind in ("component-mapping", "config-mapping"):
            return types.GenericAlias(dict, (str, self.type))
        return self.type


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
    Section(
        "copies",
        "config-mapping",
        CopyConfig,
        optional=True,
        state="whole",
        help="named weight copies (name -> {rate, cap, delay, update_every, offload}) an update rule evaluates",
    ),
    Section("distributed", "config", DistributedConfig, optional=True, help="DeepSpeed ZeRO settings"),
    Section(
        "eval",
        "eval",
        EvalSettings,
        optional=True,
        help="held-out evaluation (optional section): eval.prompts or eval.sets, rewards, judges and settings",
    ),
    Section("reward_weights", "mapping", dict[str, float], help="weight per reward name"),
    Section("reward_frames", "config", FrameScoring, help="how image rewards score a video's frames (mean|min|first)"),
)
SECTION = {s.name: s for s in SECTIONS}
# The components of the ``eval`` section (rlpost.engine.evaluation.section.COMPONENTS; its other keys are the alarm
# and the EvalSettings).
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
        shown = [clip_text(p, MAX_PROBLEM_CHARS) for p in self.problems[:MAX_PROBLEMS_SHOWN]]
        hidden = len(self.problems) - len(shown)
        if hidden:
            shown.append(f"... and {hidden} more problem(s)")
        super().__init__("invalid recipe:\n" + "\n".join(f"  - {p}" for p in shown))


def clip_text(text: str, limit: int) -> str:
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
        copies: Named weight copies (name -> schedule, :mod:`rlpost.engine.weight_copies`), or ``None``.
        distributed: DeepSpeed ZeRO across ranks, or ``None`` (one process, plain torch backend).
        reward_frames: How an image reward's per-frame scores become one per video sample (:mod:`rlpost.ops.media`).
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
    copies: dict[str, CopyConfig] | None = None
    distributed: DistributedConfig | None = None
    reward_frames: FrameScoring = field(default_factory=FrameScoring)

    def counts(self) -> StepCounts:
        """Closed-form per-step counts from the sampler for this recipe's batch shape."""
        return self.sampler.counts(self.run.groups_per_step, self.run.samples_per_group)

    def train_counts(self) -> TrainCounts:
        """The update's denoiser rows per step, from the update rule (:meth:`PolicyOptimizer.train_counts`)."""
        return self.optimizer.train_counts(self.counts())

    def derived(self) -> dict[str, int]:
        """Derived quantities printed at start-up (never configured directly)."""
        c, t = self.counts(), self.train_counts()
        derived = {
            "groups per step": self.run.groups_per_step,
            "samples per step": c.images,  # images, or videos for a video model
            "trainable edges per step": c.trainable_edges,
            "NFE per step (rollout)": c.rollout_forwards,
            "NFE per step (training, fwd+bwd)": t.grad_rows,
        }
        derived.update({f"NFE per step (training, no-grad {name})": n for name, n in sorted(t.nograd_rows.items())})
        return derived
