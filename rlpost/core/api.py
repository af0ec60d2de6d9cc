"""Component interfaces: what a sampler, advantage estimator, reward source, policy-update rule, policy model and
prompt source must provide.

These are small abstract base classes rather than ``typing.Protocol`` because jsonargparse resolves recipe
``class_path`` short names among *subclasses* of the declared type; they hold no implementation to inherit
(torchtune's "no implementation inheritance" rule), only the contract, the self-naming ``name`` and the
capability sets used by ``rlpost validate``.

Every component names itself with a kebab-case ``name`` (used in recipes, logs and manifests). Samplers declare
``provides`` (e.g. ``{"tree"}``), estimators declare ``requires``; a recipe pairing an estimator with a sampler that
does not provide what it requires is rejected before any model loads.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rlpost.core.contract import PromptBatch, RewardScores, Rollout

__all__ = [
    "AdvantageEstimator",
    "Advantages",
    "Component",
    "Conditioning",
    "EdgeEval",
    "Policy",
    "PolicyOptimizer",
    "PromptSource",
    "RewardSource",
    "Sampler",
    "StepCounts",
    "TrainBackend",
    "UpdateContext",
    "UpdateResult",
    "update_result_problems",
]


class Component(ABC):  # noqa: B024 - a marker base: subclasses define the abstract methods of their kind
    """Base of every registrable component. ``name`` is the kebab-case short name used in recipes."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""

    def validate(self, recipe: Any) -> list[str]:
        """Return human-readable problems with this component in the context of the whole recipe.

        Called by ``rlpost validate`` and before training, before any model is loaded. The default finds none.

        Args:
            recipe: The resolved :class:`rlpost.engine.recipe.Recipe` (with instantiated components).
        """
        return []

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (JSON-serialisable values or tensors). Default: stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional, stateless by default
        """Restore what :meth:`state_dict` returned."""


# ---------------------------------------------------------------------------------------------------- policy


@dataclass
class Conditioning:
    """Encoded prompts, one row per prompt (model specific tensors, e.g. SD3's ``prompt_embeds`` and
    ``pooled_prompt_embeds``, each with the negative-prompt rows when classifier-free guidance is on).

    Attributes:
        tensors: Name -> tensor whose first dimension indexes prompts.
    """

    tensors: dict[str, Tensor]

    def select(self, rows: Tensor) -> Conditioning:
        """Return the conditioning of ``rows`` (a ``[B]`` long tensor of prompt indices)."""
        return Conditioning({k: v.index_select(0, rows.to(v.device)) for k, v in self.tensors.items()})


class Policy(Component):
    """A flow-matching text-to-image model seen as a denoising policy (rectified flow: ``x_σ = (1-σ)x0 + σε``).

    The model adapter hides everything model specific (prompt encoding, the transformer call signature, latent
    packing, VAE decoding) so samplers and update rules are written once for SD3, FLUX or a test model.
    """

    kind: ClassVar[str] = "model"

    forward_count: int = 0
    """Denoiser evaluations so far, in batch rows before CFG doubling, summed over :meth:`velocity` calls.

    Adapters add each call's ``B`` in :meth:`velocity`; readers (tests, ``rlpost bench``) take differences around a
    rollout or an update and compare them with :meth:`Sampler.counts`. Never reset by the core."""

    @abstractmethod
    def setup(self, device: torch.device) -> None:
        """Load weights and move to ``device``. Called once by the runner, after validation."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device of the denoiser."""

    @abstractmethod
    def sigmas(self, num_steps: int) -> Tensor:
        """``[num_steps + 1]`` fp32 noise levels from 1 (noise) to 0 (data), time-shifted as the model expects.

        This is the run's one time grid: every sampler and the held-out evaluation step through it. Adapters build
        it with :func:`rlpost.ops.schedules.time_grid_sigmas` from a recipe-level grid name (SD3:
        ``model.init_args.time_grid``, ``"diffusers"`` or ``"shifted-linspace"``), so one recipe value sets it for
        all of them.
        """

    @abstractmethod
    def initial_noise(self, num: int, generator: torch.Generator) -> Tensor:
        """``[num, *latent_shape]`` fp32 standard normal latents drawn from ``generator``."""

    @abstractmethod
    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts (cached per prompt string); one row per prompt."""

    @abstractmethod
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        """Predict the velocity ``v ≈ ε - x0`` (classifier-free guidance applied) in fp32.

        Args:
            latents: ``[B, *latent_shape]`` states.
            sigma: ``[B]`` noise level of each state.
            cond: Conditioning with ``B`` rows (already selected per state).
        """

    @abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Decode clean latents to ``[B, H, W, 3]`` uint8 images."""

    @abstractmethod
    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates (LoRA adapters or the whole denoiser)."""

    def clean_tail_steps(self) -> int | None:
        """How many final steps of this model's time grid land on a (near-)clean level, for any ``T >= 2``.

        Samplers that must not leave sampled noise in the decoded image keep those steps deterministic and check
        their settings against it in ``validate`` (before :meth:`setup`, so adapters answer from their settings
        alone). SD3's ``"diffusers"`` grid ends ``... -> σ_min -> 0`` (2); a grid whose last nonzero level is
        ``shift(1/T)`` (SD3's ``"shifted-linspace"``, both FLUX grids) has 1. ``None`` (the default): unknown, and
        samplers skip the check. See ``docs/models.md``, "Time grids".
        """
        return None

    def reference(self) -> AbstractContextManager[None]:
        """Context in which :meth:`velocity` uses the frozen reference model (for KL terms).

        Raises:
            NotImplementedError: When the policy was not set up with a reference.
        """
        raise NotImplementedError(f"{type(self).__name__} has no frozen reference model")

    def train(self, mode: bool = True) -> None:  # noqa: B027 - optional hook with a no-op default
        """Put the trainable module in train (``True``) or eval mode."""


# --------------------------------------------------------------------------------------------------- sampler


@dataclass(frozen=True)
class EdgeEval:
    """The current policy's Gaussian for a set of edges, and the log-prob of each edge's child under it.

    Attributes:
        log_prob: ``[B]`` log-prob, reduced exactly as at rollout (same function).
        mean: ``[B, *latent_shape]`` mean of the step Gaussian.
        std: Std of the step Gaussian, broadcastable to ``mean``.
        forwards: Number of denoiser evaluations spent (one per unique parent node, times CFG passes).
    """

    log_prob: Tensor
    mean: Tensor
    std: Tensor
    forwards: int


@dataclass(frozen=True)
class StepCounts:
    """Closed-form per-step quantities a sampler reports at start-up (``rlpost validate`` prints them).

    Attributes:
        images: Images decoded and scored per training step.
        trainable_edges: Edges the update rule trains per step.
        rollout_forwards: Denoiser evaluations (batch rows, before CFG doubling) during the rollout.
        train_forwards: Denoiser evaluations (forward+backward) per pass of the update over the trainable edges.
    """

    images: int
    trainable_edges: int
    rollout_forwards: int
    train_forwards: int


class Sampler(Component):
    """Produces a :class:`~rlpost.core.contract.Rollout` and recomputes its edges' log-probs for training.

    Owning both ``rollout`` and ``evaluate`` means the kernel used to sample and the kernel used for the
    importance ratio cannot drift apart (DanceGRPO issue #87).

    A training step calls :meth:`begin_step` exactly once, then :meth:`rollout` with the whole batch (one process)
    or :meth:`rollout_groups` with the rank's groups and one generator per group (``distributed``, see
    ``rlpost/engine/sharding.py``; its default is one :meth:`rollout` per group).
    Whatever a sampler decides once per step (a window position, a progressive schedule, a draw shared by every
    group) belongs in :meth:`begin_step`; :meth:`rollout` then uses only its ``generator``, which is per group.
    """

    kind: ClassVar[str] = "sampler"
    provides: ClassVar[frozenset[str]] = frozenset()

    chunk_size: int = 0
    """Most rows per denoiser forward (and VAE decode) in :meth:`rollout`, a memory budget; 0: the whole frontier
    at once. Cost models read it to know the batch size the transformer really runs at."""

    def begin_step(self, step: int, generator: torch.Generator) -> None:  # noqa: B027 - optional, no-op default
        """Set this training step's per-step state, before any :meth:`rollout` of the step. Default: nothing.

        Called exactly once per training step whatever the number of ranks and prompt groups, so per-step state
        advances once per step. ``generator`` is a fresh stateless function of ``(run.seed, step)``, identical on
        every rank: draws made from it are shared by all groups and ranks of the step. State kept across steps must
        be in :meth:`state_dict` (or be a function of ``step``) so that a resumed run continues the same sequence.

        Args:
            step: Index of the training step about to run (0-based; equals the number of completed steps).
            generator: The step's CPU generator.
        """

    @abstractmethod
    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        """Sample images for ``batch``, recording nodes, edges and old log-probs. Runs under ``torch.no_grad``.

        ``generator`` drives this batch's noise only; with several calls per step (one per group under
        ``distributed``) each call gets its own, so nothing drawn here may be meant to be shared by the whole step.
        """

    def rollout_groups(self, policy: Policy, batch: PromptBatch, generators: Sequence[torch.Generator]) -> Rollout:
        """Sample ``batch``'s groups, group ``j`` with its own ``generators[j]`` (the sharded path, one generator per
        global group so results do not depend on which rank holds a group).

        The result must equal :meth:`rollout` of each group alone with its generator, merged in group order (up to
        floating-point batch effects and the order of node and edge rows). The default does exactly that, one
        rollout per group; samplers override it to batch every group's frontier into one forward per step.

        Raises:
            ValueError: When the number of generators differs from the number of groups.
        """
        from rlpost.core.merge import merge_rollouts  # merge imports contract, which this module's users import

        if len(generators) != batch.num_groups:
            raise ValueError(f"rollout_groups: {batch.num_groups} groups but {len(generators)} generators")
        parts = []
        for j, generator in enumerate(generators):
            one = PromptBatch(
                [batch.prompts[j]], [batch.metadata[j]], batch.samples_per_group, group_offset=batch.group_offset + j
            )
            parts.append(self.rollout(policy, one, generator))
        return merge_rollouts(parts)

    @abstractmethod
    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the Gaussian and log-prob of ``edges`` under the current policy, with gradients.

        Implementations evaluate the policy once per unique parent node (:meth:`Rollout.parents_of`).
        """

    @abstractmethod
    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """Closed-form counts for one step with ``num_groups`` prompt groups.

        Where a count depends on a per-step draw (TreeGRPO's window start), this is its worst case over the draw;
        :meth:`step_counts` gives the drawn step's, :meth:`expected_rollout_forwards` the expectation.
        """

    def step_counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        """The counts of the step :meth:`begin_step` last began (exact for its draws). Default: :meth:`counts`,
        which a sampler whose counts follow its per-step state (MixGRPO's window) already makes exact."""
        return self.counts(num_groups, samples_per_group)

    def expected_rollout_forwards(self, num_groups: int, samples_per_group: int) -> float:
        """Rollout denoiser rows per step averaged over the sampler's per-step draws (non-integer in general).
        Default: ``counts(...).rollout_forwards``, for samplers that draw nothing that changes it."""
        return float(self.counts(num_groups, samples_per_group).rollout_forwards)


# ------------------------------------------------------------------------------------------------ advantages


@dataclass(frozen=True)
class Advantages:
    """Output of an advantage estimator.

    Attributes:
        edges: ``[E]`` advantage per edge of the rollout (zero on non-trainable edges).
        samples: ``[S]`` advantage of each decoded sample (leaf), for logging.
        metrics: Scalars to log under ``adv/``.
    """

    edges: Tensor
    samples: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class AdvantageEstimator(Component):
    """Turns per-source reward scores into one advantage per edge. Pure and rank agnostic: it sees the
    gathered rollout metadata of whole groups."""

    kind: ClassVar[str] = "advantage"
    requires: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        """Compute advantages for every edge of ``rollout``."""


# --------------------------------------------------------------------------------------------------- rewards


class RewardSource(Component):
    """Scores decoded images. Heavy models are loaded in :meth:`setup` (once), never at import or registration."""

    kind: ClassVar[str] = "reward"

    def setup(self, device: torch.device) -> None:  # noqa: B027 - weight-free rewards need no set-up
        """Load models onto ``device``. Called once before the first :meth:`score`."""

    @abstractmethod
    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        """Return a ``[S]`` float tensor of finite scores for ``[S, H, W, 3]`` uint8 ``images``."""


# ------------------------------------------------------------------------------------------------- optimizer


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


# --------------------------------------------------------------------------------------------------- prompts


class PromptSource(Component):
    """A finite list of prompts with metadata, shuffled deterministically per epoch by the core."""

    kind: ClassVar[str] = "prompts"

    @abstractmethod
    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """Return all ``(prompt, metadata)`` pairs. Called once."""


def iter_kinds() -> Iterator[type[Component]]:
    """The component base classes, in registry order."""
    yield from (Sampler, AdvantageEstimator, RewardSource, PolicyOptimizer, Policy, PromptSource)
