"""The policy-update-rule contract: what an update gets (``UpdateContext``) and must return (``UpdateResult``).

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
from torch import Tensor

from rlpost.core.api.advantage import Advantages
from rlpost.core.api.component import Component
from rlpost.core.api.policy import Policy
from rlpost.core.api.sampler import Sampler
from rlpost.core.contract import Rollout

__all__ = ["PolicyOptimizer", "TrainBackend", "UpdateContext", "UpdateResult", "update_result_problems"]


class TrainBackend(ABC):
    """How gradients become weight updates: plain torch on one process, DeepSpeed ZeRO across ranks."""

    @abstractmethod
    def backward(self, loss: Tensor) -> None:
        """Accumulate gradients of ``loss``.

        A non-finite ``loss`` is refused (no gradient) and counted by the engine's backends, so the run's guards see
        it whether or not the update rule checked first.
        """

    @abstractmethod
    def step(self) -> dict[str, float]:
        """Clip gradients, step the torch optimizer and LR scheduler, zero gradients. A step whose gradient is not
        finite is skipped (weights untouched) and counted by the engine's backends.

        Returns:
            Metrics such as ``train/grad_norm`` and ``train/lr``.
        """

    @property
    def world_size(self) -> int:
        """Number of ranks sharing the update."""
        return 1


@dataclass
class UpdateContext:
    """What a policy-update rule needs for one training step.

    Attributes:
        policy: The policy being trained.
        sampler: The sampler that produced ``rollout`` (its :meth:`Sampler.evaluate` gives current log-probs).
        rollout: This step's rollout.
        advantages: Per-edge advantages.
        backend: Gradient/optimizer backend.
        generator: RNG for minibatch shuffling.
        step: Global training step (0-based).
    """

    policy: Policy
    sampler: Sampler
    rollout: Rollout
    advantages: Advantages
    backend: TrainBackend
    generator: torch.Generator
    step: int


@dataclass(frozen=True, kw_only=True)
class UpdateResult:
    """What a policy-update rule reports of one step's update (:meth:`PolicyOptimizer.update`).

    The counts are what the runner's guards and the cost accounting rely on, so they are required, typed fields: a
    rule cannot leave one out and silently switch a guard or a cost check off (the runner refuses anything else,
    naming the plugin). What the engine can see itself is not asked for: the backend counts the non-finite losses
    passed to :meth:`TrainBackend.backward` (refused) and the optimizer steps skipped for a non-finite gradient
    (``train/nonfinite_grad_steps``). Each count is logged under the metric name in :attr:`METRIC_NAMES`
    (``docs/logging.md``).

    Attributes:
        trained_edges: Distinct edges the update trained (``train/edges``).
        train_forwards: Denoiser rows evaluated with gradients over all passes, the summed ``EdgeEval.forwards``
            (``perf/train_forwards``): ``StepCounts.train_forwards * inner_epochs`` for a rule that trains every
            trainable edge once per pass.
        reference_forwards: No-grad rows of the frozen reference policy, a KL term's (``perf/reference_forwards``):
            ``train_forwards * reference_forwards_per_train_forward()``.
        nonfinite_losses: Losses the rule found non-finite and kept from ``backward`` (the runner adds the ones the
            backend refused; together ``train/nonfinite_loss``, which the loss guard acts on).
        metrics: Everything else to log (``loss/*``, ``kl/*``, ``train/*``): namespaced names to floats.
    """

    trained_edges: int
    train_forwards: int
    reference_forwards: int
    nonfinite_losses: int
    metrics: dict[str, float] = field(default_factory=dict)

    METRIC_NAMES: ClassVar[Mapping[str, str]] = {
        "trained_edges": "train/edges",
        "train_forwards": "perf/train_forwards",
        "reference_forwards": "perf/reference_forwards",
        "nonfinite_losses": "train/nonfinite_loss",
    }
    """Count field -> the metric it is logged as."""

    ENGINE_METRICS: ClassVar[tuple[str, ...]] = ("train/nonfinite_grad_steps",)
    """Update metrics the engine writes from what the backend counted."""

    @classmethod
    def count_fields(cls) -> tuple[str, ...]:
        """The required count fields, in declaration order."""
        return tuple(f.name for f in fields(cls) if f.name != "metrics")


def update_result_problems(value: object) -> list[str]:
    """Why ``value`` is not a valid :class:`UpdateResult` (empty when it is): the wrong type, a missing field, a count
    that is not an integer ``>= 0``, or a metric that is not a float or takes a count's name."""
    required = UpdateResult.count_fields()
    if not isinstance(value, UpdateResult):
        expected = f"expected rlpost.UpdateResult with the required fields {', '.join(required)}"
        if isinstance(value, Mapping):
            why = "the runner's guards and cost accounting read them"
            return [f"returned a {type(value).__name__} of metrics, {expected} ({why})"]
        missing = ", ".join(name for name in required if not hasattr(value, name))
        return [f"returned {type(value).__name__}, {expected}" + (f"; it lacks {missing}" if missing else "")]
    problems = []
    for name in required:
        count = getattr(value, name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            problems.append(f"UpdateResult.{name}: must be an integer >= 0, got {count!r}")
    if not isinstance(value.metrics, Mapping):
        return [*problems, f"UpdateResult.metrics: must be a dict of floats, got {type(value.metrics).__name__}"]
    reserved = {metric: name for name, metric in UpdateResult.METRIC_NAMES.items()}
    for key, metric in value.metrics.items():
        if not isinstance(key, str):
            problems.append(f"UpdateResult.metrics: keys must be metric names (str), got {key!r}")
        elif key in reserved:
            problems.append(f"UpdateResult.metrics[{key!r}]: logged from the field {reserved[key]}; set that instead")
        elif key in UpdateResult.ENGINE_METRICS:
            problems.append(f"UpdateResult.metrics[{key!r}]: the engine counts it from the backend; leave it out")
        elif isinstance(metric, bool) or not isinstance(metric, numbers.Real):
            problems.append(f"UpdateResult.metrics[{key!r}]: must be a float, got {type(metric).__name__}")
    return problems


class PolicyOptimizer(Component):
    """The policy-update rule: which loss (clipped surrogate, KL terms), inner epochs and edge minibatching.
    Torch optimizers themselves are chosen in the recipe (``torch_optimizer``)."""

    kind: ClassVar[str] = "optimizer"

    inner_epochs: int = 1
    """Passes over the rollout's trainable edges per step: the update's denoiser rows per step are
    ``StepCounts.train_forwards * inner_epochs``."""

    minibatch_edges: int = 0
    """Most edges per forward/backward chunk (a memory budget); 0: all of a step's edges at once. Cost models read
    it to know the batch size the update's transformer calls run at."""

    def reference_forwards_per_train_forward(self) -> int:
        """No-grad forwards of a frozen reference policy (a KL term's) per training forward; 0 without one.

        Cost models count ``StepCounts.train_forwards * inner_epochs *`` this many forward-only rows per step on top of
        the update's forward+backward rows, and the update reports them as ``UpdateResult.reference_forwards``.
        """
        return 0

    @abstractmethod
    def update(self, ctx: UpdateContext) -> UpdateResult:
        """Run the update for one step: evaluate the trainable edges (``ctx.sampler.evaluate``), pass each loss to
        ``ctx.backend.backward`` and step with ``ctx.backend.step``.

        Returns:
            The step's counts and metrics. Anything but an :class:`UpdateResult` with every field ends the run with
            an error naming this plugin (``rlpost.testing.check_update_rule`` checks a rule against the contract).
        """
