"""The policy-update-rule contract: what an update gets (``UpdateContext``) and must return (``UpdateResult``).

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
from torch import Tensor

from rlpost.core.api.advantage import Advantages
from rlpost.core.api.capabilities import DEFAULT_UPDATE_REQUIRES
from rlpost.core.api.component import Component
from rlpost.core.api.copies import REFERENCE, WeightCopies
from rlpost.core.api.policy import Policy
from rlpost.core.api.sampler import Sampler, StepCounts
from rlpost.core.contract import Rollout

__all__ = [
    "PolicyOptimizer",
    "TrainBackend",
    "TrainCounts",
    "UpdateContext",
    "UpdateResult",
    "update_result_problems",
]


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


class _ReferenceOnly(WeightCopies):
    """The copies of a run that declares none: only the frozen reference."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def names(self) -> tuple[str, ...]:
        return (REFERENCE,)

    def use(self, name: str) -> AbstractContextManager[None]:
        if name != REFERENCE:
            raise KeyError(f"no weight copy {name!r}: this run keeps only {REFERENCE!r} (recipe section 'copies')")
        return self.policy.reference()


@dataclass
class UpdateContext:
    """What a policy-update rule needs for one training step.

    Attributes:
        policy: The policy being trained.
        sampler: The sampler that produced ``rollout`` (with ``edge-log-probs``, its :meth:`Sampler.evaluate` gives
            current log-probs).
        rollout: This step's rollout (this rank's groups).
        advantages: Per-sample and per-edge advantages of ``rollout``.
        backend: Gradient/optimizer backend.
        generator: RNG for minibatch shuffling (this rank's).
        step: Global training step (0-based).
        copies: The run's weight copies (:class:`~rlpost.core.api.WeightCopies`); default: only the frozen
            reference.
        seed: The run's root seed, for draws that must not depend on the rank count: derive a generator from
            ``(seed, step, global sample or group index)`` with :func:`rlpost.ops.training_noise.keyed_generator`.
    """

    policy: Policy
    sampler: Sampler
    rollout: Rollout
    advantages: Advantages
    backend: TrainBackend
    generator: torch.Generator
    step: int
    copies: WeightCopies | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.copies is None:
            self.copies = _ReferenceOnly(self.policy)

    @property
    def weight_copies(self) -> WeightCopies:
        """:attr:`copies`, never ``None``."""
        assert self.copies is not None
        return self.copies


@dataclass(frozen=True)
class TrainCounts:
    """The denoiser rows one training step's update runs: what ``rlpost validate`` prints, the bench's cost model
    predicts and the counted-rows check compares with what ran. The update rule owns it
    (:meth:`PolicyOptimizer.train_counts`): a likelihood-free rule decides its own timesteps, so the sampler cannot.

    Attributes:
        grad_rows: Rows of the live policy evaluated with gradients (forward + backward), all passes together.
        nograd_rows: Copy name (``"reference"``, ``"old"``, ...) -> forward-only rows of that weight copy
            (:class:`~rlpost.core.api.WeightCopies`); zero entries are left out.
        rows_per_call: Rows per transformer call of the update (its minibatch), for cost models that price a row by
            the batch it runs in; 0: derived from ``minibatch_edges`` (a policy-gradient rule's edges).
    """

    grad_rows: int
    nograd_rows: Mapping[str, int] = field(default_factory=dict)
    rows_per_call: int = 0

    @property
    def nograd_total(self) -> int:
        """Forward-only rows of every copy together (``UpdateResult.reference_forwards``)."""
        return int(sum(self.nograd_rows.values()))


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
        reference_forwards: No-grad rows of every weight copy together (the frozen reference a KL term evaluates,
            an "old" or EMA copy; ``perf/reference_forwards``): ``TrainCounts.nograd_total`` of
            :meth:`PolicyOptimizer.train_counts`.
        nonfinite_losses: Losses the rule found non-finite and kept from ``backward`` (the runner adds the ones the
            backend refused; together ``train/nonfinite_loss``, which the loss guard acts on).
        metrics: Everything else to log (``loss/*``, ``kl/*``, ``train/*``): namespaced names to floats.
        copy_forwards: ``reference_forwards`` split by weight copy (name -> rows), for a rule that evaluates more
            than the frozen reference; empty means all of them were the reference's.
    """

    trained_edges: int
    train_forwards: int
    reference_forwards: int
    nonfinite_losses: int
    metrics: dict[str, float] = field(default_factory=dict)
    copy_forwards: Mapping[str, int] = field(default_factory=dict)

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
        return tuple(f.name for f in fields(cls) if f.name not in ("metrics", "copy_forwards"))


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
    copies = value.copy_forwards
    if not isinstance(copies, Mapping) or any(
        not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0 for k, v in copies.items()
    ):
        problems.append(f"UpdateResult.copy_forwards: must map copy names to integers >= 0, got {copies!r}")
    elif copies and sum(copies.values()) != value.reference_forwards:
        problems.append(
            f"UpdateResult.copy_forwards: sums to {sum(copies.values())}, not reference_forwards = "
            f"{value.reference_forwards}"
        )
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
    """The policy-update rule: which loss (clipped surrogate, KL terms, a likelihood-free flow-matching loss), inner
    epochs and minibatching, what it needs of the sampler (:attr:`requires`), which weight copies it evaluates
    (:meth:`required_copies`), which one the rollout runs under (:meth:`rollout_copy`) and what its update costs
    (:meth:`train_counts`). Torch optimizers themselves are chosen in the recipe (``torch_optimizer``)."""

    kind: ClassVar[str] = "optimizer"
    requires: ClassVar[frozenset[str]] = DEFAULT_UPDATE_REQUIRES
    """Capabilities the sampler must provide (:mod:`rlpost.core.api.capabilities`). The default, for a rule that
    declares nothing, is ``{"edge-log-probs"}`` (a policy-gradient rule calling :meth:`Sampler.evaluate`);
    likelihood-free rules declare ``{"clean-samples"}``."""

    inner_epochs: int = 1
    """Passes over the rollout's trainable edges per step: the update's denoiser rows per step are
    ``StepCounts.train_forwards * inner_epochs``."""

    minibatch_edges: int = 0
    """Most edges per forward/backward chunk (a memory budget); 0: all of a step's edges at once. Cost models read
    it to know the batch size the update's transformer calls run at."""

    def train_counts(self, counts: StepCounts) -> TrainCounts:
        """The denoiser rows one step's update runs, given the sampler's closed-form ``counts`` for the step.

        Default (a policy-gradient rule training every trainable edge once per pass): ``counts.train_forwards *
        inner_epochs`` rows with gradients, and that times :meth:`reference_forwards_per_train_forward` no-grad rows
        of the frozen reference. A rule that chooses its own timesteps or evaluates other copies overrides it; the
        update must report exactly these counts (``UpdateResult.train_forwards``, ``reference_forwards``,
        ``copy_forwards``), which the conformance kit and the bench check.
        """
        grad = counts.train_forwards * self.inner_epochs
        ref = grad * self.reference_forwards_per_train_forward()
        return TrainCounts(grad_rows=grad, nograd_rows={REFERENCE: ref} if ref else {})

    def required_copies(self) -> frozenset[str]:
        """Names of the weight copies (recipe section ``copies``) this rule evaluates or rolls out under, besides the
        always-present ``reference``; ``rlpost validate`` refuses a recipe that lacks one. Default: none."""
        return frozenset()

    def rollout_copy(self, step: int) -> str | None:
        """The weight copy training step ``step``'s rollout runs under (``None``: the live weights, the default).

        DiffusionNFT samples with its "old" copy; DGPO switches to its EMA reference after a set step.
        """
        return None

    def reference_forwards_per_train_forward(self) -> int:
        """No-grad forwards of a frozen reference policy (a KL term's) per training forward; 0 without one.

        Cost models count ``StepCounts.train_forwards * inner_epochs *`` this many forward-only rows per step on top of
        the update's forward+backward rows, and the update reports them as ``UpdateResult.reference_forwards``.
        """
        return 0

    @abstractmethod
    def update(self, ctx: UpdateContext) -> UpdateResult:
        """Run the update for one step: compute the losses (a policy-gradient rule evaluates the trainable edges with
        ``ctx.sampler.evaluate``; a likelihood-free rule re-noises the clean samples), pass each to
        ``ctx.backend.backward`` and step with ``ctx.backend.step``.

        Returns:
            The step's counts and metrics. Anything but an :class:`UpdateResult` with every field ends the run with
            an error naming this plugin (``rlpost.testing.check_update_rule`` checks a rule against the contract).
        """
