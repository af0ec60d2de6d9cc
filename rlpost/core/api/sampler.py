"""The sampler contract: rollouts (clean samples, and for stochastic samplers per-edge log-probs) and the
recomputation of edge log-probs for policy-gradient training (the ``edge-log-probs`` capability).

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from rlpost.core.api.capabilities import CLEAN_SAMPLES, EDGE_LOG_PROBS
from rlpost.core.api.component import Component
from rlpost.core.api.policy import Policy
from rlpost.core.contract import PromptBatch, Rollout

__all__ = ["EdgeEval", "Sampler", "StepCounts"]


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
    """Produces a :class:`~rlpost.core.contract.Rollout`; a stochastic sampler also recomputes its edges' log-probs
    for training.

    What a sampler's rollouts offer is declared in :attr:`provides` (:mod:`rlpost.core.api.capabilities`): every
    sampler provides ``clean-samples`` (the default); one that records stochastic edges and implements
    :meth:`evaluate` adds ``edge-log-probs``. Owning both ``rollout`` and ``evaluate`` means the kernel used to sample
    and the kernel used for the importance ratio cannot drift apart (XueZeyue/DanceGRPO issue #87).

    A training step calls :meth:`begin_step` exactly once, then :meth:`rollout` with the whole batch (one process)
    or :meth:`rollout_groups` with the rank's groups and one generator per group (``distributed``, see
    ``rlpost/engine/sharding.py``; its default is one :meth:`rollout` per group).
    Whatever a sampler decides once per step (a window position, a progressive schedule, a draw shared by every
    group) belongs in :meth:`begin_step`; :meth:`rollout` then uses only its ``generator``, which is per group.
    """

    kind: ClassVar[str] = "sampler"
    provides: ClassVar[frozenset[str]] = frozenset({CLEAN_SAMPLES})
    """Capabilities of this sampler's rollouts (:mod:`rlpost.core.api.capabilities`); ``rlpost validate`` checks the
    advantage estimator's and the update rule's ``requires`` against it. A sampler that implements :meth:`evaluate`
    declares ``edge-log-probs``."""

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

    def begin_run_step(self, step: int, max_steps: int) -> None:  # noqa: B027 - optional, no-op default
        """How far the run has got, before each training step (before :meth:`begin_step`). Default: nothing.

        For a schedule over the run's length rather than an iteration count (MixGRPO's window with ``shift_over:
        steps``): ``step / (max_steps - 1)`` is the fraction of the run done, the same reading as
        :class:`rlpost.RunLengthLR` ``over: steps``.

        Args:
            step: Index of the training step about to run (0-based).
            max_steps: ``run.max_steps``.
        """

    def end_run_step(self, seconds: float) -> None:  # noqa: B027 - optional, no-op default
        """The training step just run took ``seconds`` of wall time (the slowest rank's, identical on every rank).
        Default: nothing.

        For a schedule over a training-time budget (``shift_over: time``, as :class:`rlpost.RunLengthLR` ``over:
        time``): a sampler that sums these keeps the sum in :meth:`state_dict`, so a resumed run continues it.
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

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        """Recompute the Gaussian and log-prob of ``edges`` under the current policy, with gradients: the
        ``edge-log-probs`` capability. Only policy-gradient update rules call it, and only when the sampler declares
        the capability (``rlpost validate`` refuses any other pairing).

        Implementations evaluate the policy once per unique parent node (:meth:`Rollout.parents_of`).

        Raises:
            NotImplementedError: The sampler does not provide ``edge-log-probs`` (the default).
        """
        raise NotImplementedError(
            f"sampler {self.name or type(self).__name__!r} does not provide {EDGE_LOG_PROBS!r}: its rollouts have no "
            "edge log-probs to recompute"
        )

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
