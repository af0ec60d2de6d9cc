"""How one training step's work is split across ranks, so that results do not depend on the number of ranks.

* **Prompt order is global.** Every rank advances the same seeded :class:`~rlpost.components.prompts.PromptStream` by
  ``run.groups_per_step`` groups and keeps its contiguous slice (``PromptBatch.group_offset`` = the global index of
  its first group within the step).
* **Per-step state is set once per step.** Before any rollout of step ``t``, every rank calls
  :meth:`Sampler.begin_step <rlpost.core.api.Sampler.begin_step>` once with a generator seeded from ``(seed, stream 3,
  t)``: what a sampler draws or advances once per step (a tree's window start, MixGRPO's window position) is the
  same on every rank and for every group, and advances once per step whatever the rank and group counts.
* **Rollout noise is per group.** Group ``g`` (global index within step ``t``) draws from its own generator
  seeded from ``(seed, stream 1, t, g)`` (:meth:`Sampler.rollout_groups <rlpost.core.api.Sampler.rollout_groups>`; a
  sampler may batch a rank's groups in one forward per step, the draws stay per group), so its initial noise, SDE
  noise and per-sample draws (DanceGRPO's trained steps) are the same whichever rank samples it and however many
  groups that rank holds.
* **Minibatch shuffling** uses a generator seeded from ``(seed, stream 2, t, rank)``: it only decides which of this
  rank's edges share a forward, which does not change a one-optimizer-step update.
* **Advantages are computed on the gathered view**: every rank contributes a skeleton of its rollout (node/edge/sample
  tables without latents or images) and its reward scores; the estimator runs on the merged view of whole groups
  (identical on every rank; groups are keyed by global id, so a group whose trees lie on several ranks is still
  normalised as one) and each rank slices back its own edges and samples.

All streams are stateless functions of the step, so a checkpoint resumes on any number of ranks.
:class:`LocalSharding` is the single-process behaviour: the same per-step generator (so per-step state matches the
sharded path), then one rollout of the whole batch with the run's stateful rollout generator (stream 1), and the
stateful minibatch generator (stream 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from rlpost.components.prompts import PromptStream
from rlpost.core.api import Advantages, Policy, Sampler, UpdateResult
from rlpost.core.contract import PromptBatch, RewardScores, Rollout
from rlpost.core.merge import merge_rollouts
from rlpost.engine.guards import Guards

__all__ = [
    "STREAM_GUARD",
    "STREAM_MINIBATCH",
    "STREAM_ROLLOUT",
    "STREAM_STEP",
    "GroupSharding",
    "GroupView",
    "LocalSharding",
    "UpdateTotals",
    "begin_step",
    "derived_generator",
    "gather_view",
    "group_rollouts",
    "merge_rollouts",
    "reduce_metrics",
    "reduce_updates",
    "skeleton",
    "stream_generator",
]

# Offsets that derive independent RNG streams from the root seed (documented in docs/design.md); the one place they
# are defined: the runner's single-process streams and the per-group streams below both use them.
STREAM_ROLLOUT = 1
STREAM_MINIBATCH = 2
STREAM_STEP = 3  # per-step sampler state (Sampler.begin_step), on every path
STREAM_GUARD = 4  # the speed-up guards' own draws (rlpost.engine.ratio_guard): no run stream is touched

GatherFn = Callable[[Any], list[Any]]


def derived_generator(seed: int, stream: int, step: int, index: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, stream, step, index)`` through NumPy's ``SeedSequence`` (well mixed:
    neighbouring steps or groups get unrelated streams)."""
    entropy = np.random.SeedSequence([seed % 2**63, stream, step, index]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(entropy[0]) << 32 | int(entropy[1]))


def stream_generator(seed: int, stream: int) -> torch.Generator:
    """The run's stateful single-process generator of ``stream`` (seeded ``seed * 1_000_003 + stream``)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def group_rollouts(
    sampler: Sampler, policy: Policy, batch: PromptBatch, seed: int, step: int, groups_per_part: int
) -> Iterator[Rollout]:
    """Step ``step``'s rollout of ``batch`` in parts of at most ``groups_per_part`` groups, each group with its own
    ``(seed, stream 1, step, global group)`` generator (:meth:`Sampler.rollout_groups`): a part is sampled only when
    the caller asks for it, so the caller can score one part while the next samples (``run.speedups.overlap``).

    The parts' groups draw exactly what they draw in one call over the whole batch (the generators are per group);
    only the batch a transformer forward runs at changes, i.e. results agree up to floating-point batch effects.
    ``begin_step`` is the caller's (once per step).
    """
    for lo in range(0, batch.num_groups, groups_per_part):
        part = PromptBatch(
            prompts=batch.prompts[lo : lo + groups_per_part],
            metadata=batch.metadata[lo : lo + groups_per_part],
            samples_per_group=batch.samples_per_group,
            group_offset=batch.group_offset + lo,
        )
        generators = [
            derived_generator(seed, STREAM_ROLLOUT, step, part.group_offset + j) for j in range(part.num_groups)
        ]
        yield sampler.rollout_groups(policy, part, generators)


def begin_step(sampler: Sampler, seed: int, step: int) -> None:
    """Call ``sampler.begin_step`` for ``step`` with the step's generator ``(seed, STREAM_STEP, step, 0)``.

    The generator depends on neither the rank nor the groups, so every rank sets the same per-step state.
    """
    sampler.begin_step(step, derived_generator(seed, STREAM_STEP, step, 0))


# ---------------------------------------------------------------------------------------------- rollout tables


def skeleton(rollout: Rollout) -> Rollout:
    """The rollout's tables without latents and pixels: what an advantage estimator may read, cheap to gather.
    Latent-sized ``edge_extras`` stay on their rank (the update rule reads them from the rank's own rollout)."""
    return replace(
        rollout,
        states=torch.empty(rollout.num_nodes, 0),
        media=torch.empty(rollout.num_samples, rollout.num_frames, 0, 0, 3, dtype=torch.uint8),
        sigmas=rollout.sigmas.detach().cpu(),
        node_step=rollout.node_step.cpu(),
        node_group=rollout.node_group.cpu(),
        edge_parent=rollout.edge_parent.cpu(),
        edge_child=rollout.edge_child.cpu(),
        old_log_probs=rollout.old_log_probs.detach().cpu(),
        trainable=rollout.trainable.cpu(),
        edge_kernel=rollout.edge_kernel.cpu(),
        sample_node=rollout.sample_node.cpu(),
        sample_group=rollout.sample_group.cpu(),
        stats=dict(rollout.stats),
        edge_extras={},
    )


@dataclass
class GroupView:
    """The gathered view of one step and where this rank's rows sit in it.

    Attributes:
        rollout: Merged skeleton of every rank's rollout (what the advantage estimator sees).
        scores: Every rank's reward scores concatenated in rank order (aligned with ``rollout``'s samples).
        edges: Slice of this rank's edges in the merged edge table.
        samples: Slice of this rank's samples in the merged sample table.
        loss_weight: ``W·E_r/E``: this rank's trainable-edge share times the world size (1.0 when equal).
    """

    rollout: Rollout
    scores: RewardScores
    edges: slice
    samples: slice
    loss_weight: float = 1.0

    def local(self, advantages: Advantages) -> Advantages:
        """This rank's rows of advantages computed on the merged view (metrics stay global)."""
        return Advantages(
            edges=advantages.edges[self.edges], samples=advantages.samples[self.samples], metrics=advantages.metrics
        )


def gather_view(rollout: Rollout, scores: RewardScores, rank: int, gather: GatherFn) -> GroupView:
    """Gather every rank's rollout skeleton and scores and merge them (a collective when ``gather`` is one).

    Args:
        rollout: This rank's rollout.
        scores: This rank's reward scores.
        rank: This rank's index in ``gather``'s output.
        gather: ``obj -> [obj of rank 0, obj of rank 1, ...]`` (``World.all_gather``, or a fake in tests).
    """
    payload = (skeleton(rollout), {k: v.detach().cpu() for k, v in scores.scores.items()})
    parts = gather(payload)
    merged = merge_rollouts([p[0] for p in parts])
    merged_scores = RewardScores(
        scores={k: torch.cat([p[1][k] for p in parts]) for k in scores.scores}, weights=dict(scores.weights)
    )
    e0 = sum(p[0].num_edges for p in parts[:rank])
    s0 = sum(p[0].num_samples for p in parts[:rank])
    total = int(merged.trainable.sum())
    mine = int(rollout.trainable.sum())
    weight = len(parts) * mine / total if total else 1.0
    return GroupView(
        rollout=merged,
        scores=merged_scores,
        edges=slice(e0, e0 + rollout.num_edges),
        samples=slice(s0, s0 + rollout.num_samples),
        loss_weight=weight,
    )


@dataclass(frozen=True)
class UpdateTotals:
    """One step's update as the runner records it: the rule's :class:`~rlpost.core.api.UpdateResult` and what the
    backend counted while it ran (summed over ranks by :meth:`GroupSharding.reduce`).

    Attributes:
        result: The update rule's result.
        refused_losses: Non-finite losses the backend refused in ``backward``.
        nonfinite_grad_steps: Optimizer steps the backend skipped for a non-finite gradient.
    """

    result: UpdateResult
    refused_losses: int = 0
    nonfinite_grad_steps: int = 0

    @property
    def nonfinite_losses(self) -> int:
        """The step's non-finite losses, those the rule kept from ``backward`` and those the backend refused."""
        return self.result.nonfinite_losses + self.refused_losses

    def metrics(self) -> dict[str, float]:
        """The update's metrics as logged: the rule's, then each count under its name (``docs/logging.md``)."""
        out = dict(self.result.metrics)
        for name, metric in UpdateResult.METRIC_NAMES.items():
            out[metric] = float(getattr(self.result, name))
        out[UpdateResult.METRIC_NAMES["nonfinite_losses"]] = float(self.nonfinite_losses)
        out["train/nonfinite_grad_steps"] = float(self.nonfinite_grad_steps)
        return out


def reduce_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine per-rank update-rule metrics: ``*_min``/``*_max`` by min/max, the rest by mean (the counts are typed
    fields, summed by :func:`reduce_updates`)."""
    out: dict[str, float] = {}
    for key in parts[0]:
        values = [float(p[key]) for p in parts if key in p]
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def reduce_updates(parts: Sequence[UpdateTotals]) -> UpdateTotals:
    """Combine per-rank updates: every count and each weight copy's no-grad rows by sum, the metrics by
    :func:`reduce_metrics`."""
    counts = {name: sum(getattr(p.result, name) for p in parts) for name in UpdateResult.count_fields()}
    copies: dict[str, int] = {}
    if any(p.result.copy_forwards for p in parts):  # a rank without a split spent its no-grad rows on the reference
        for p in parts:
            split = p.result.copy_forwards or (
                {"reference": p.result.reference_forwards} if p.result.reference_forwards else {}
            )
            for name, rows in split.items():
                copies[name] = copies.get(name, 0) + int(rows)
    metrics = reduce_metrics([p.result.metrics for p in parts])
    result = UpdateResult(**counts, metrics=metrics, copy_forwards=copies)
    return UpdateTotals(result, sum(p.refused_losses for p in parts), sum(p.nonfinite_grad_steps for p in parts))


# ------------------------------------------------------------------------------------------------ strategies


class LocalSharding:
    """One process: the stream's next groups, one rollout of them all with the run's rollout generator.

    Args:
        seed: The run's root seed (for the per-step generator, as in :class:`GroupSharding`).
        rollout_gen: The run's stateful rollout generator (stream 1).
        minibatch_gen: The run's stateful minibatch generator (stream 2).
    """

    rank = 0
    world_size = 1

    def __init__(self, seed: int, rollout_gen: torch.Generator, minibatch_gen: torch.Generator) -> None:
        self.seed = seed
        self.rollout_gen = rollout_gen
        self.minibatch_gen = minibatch_gen

    def next_batch(self, stream: PromptStream, groups: int, samples_per_group: int) -> PromptBatch:
        """The next ``groups`` prompt groups."""
        return stream.next_batch(groups, samples_per_group)

    def rollout(self, sampler: Sampler, policy: Policy, batch: PromptBatch, step: int) -> Rollout:
        """Step ``step``'s rollout: :func:`begin_step` once, then one rollout of the whole batch.

        Call once per training step: it advances the sampler's per-step state.
        """
        begin_step(sampler, self.seed, step)
        return sampler.rollout(policy, batch, self.rollout_gen)

    def rollout_parts(
        self, sampler: Sampler, policy: Policy, batch: PromptBatch, step: int, groups_per_part: int
    ) -> Iterator[Rollout]:
        """Step ``step``'s rollout in parts of ``groups_per_part`` groups with per-group generators
        (:func:`group_rollouts`): the sharded path's streams, not the run's stateful one, so it equals a one-rank
        ``distributed`` run (not :meth:`rollout`'s draws); ``run.speedups.overlap`` scores a part while the next
        samples."""
        begin_step(sampler, self.seed, step)
        yield from group_rollouts(sampler, policy, batch, self.seed, step, groups_per_part)

    def minibatch_generator(self, step: int) -> torch.Generator:
        """The run's minibatch generator."""
        return self.minibatch_gen

    def gather(self, rollout: Rollout, scores: RewardScores, guards: Guards) -> GroupView:
        """The rollout itself is the whole view."""
        return GroupView(rollout, scores, slice(0, rollout.num_edges), slice(0, rollout.num_samples))

    def reduce(self, update: UpdateTotals) -> UpdateTotals:
        """Nothing to reduce."""
        return update

    def max_over_ranks(self, value: float) -> float:
        """The value itself (one rank)."""
        return value

    def barrier(self) -> None:
        """Nothing to wait for."""


class GroupSharding:
    """Prompt groups split across ranks with per-group RNG streams (see the module docstring).

    Args:
        seed: The run's root seed.
        rank: This rank.
        world_size: Number of ranks (must divide ``run.groups_per_step``).
        gather: ``World.all_gather`` (or a fake).
        barrier: ``World.barrier`` (or a no-op).
    """

    def __init__(
        self, seed: int, rank: int, world_size: int, gather: GatherFn, barrier: Callable[[], None] = lambda: None
    ) -> None:
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._gather = gather
        self._barrier = barrier
        self.backend: Any = None  # set by the runner: receives each step's ``loss_weight``

    def next_batch(self, stream: PromptStream, groups: int, samples_per_group: int) -> PromptBatch:
        """Advance the global stream by ``groups`` and keep this rank's contiguous slice."""
        full = stream.next_batch(groups, samples_per_group)
        per = groups // self.world_size
        lo = self.rank * per
        return PromptBatch(
            prompts=full.prompts[lo : lo + per],
            metadata=full.metadata[lo : lo + per],
            samples_per_group=samples_per_group,
            group_offset=full.group_offset + lo,
        )

    def rollout(self, sampler: Sampler, policy: Policy, batch: PromptBatch, step: int) -> Rollout:
        """Step ``step``'s rollout: :func:`begin_step` once, then :meth:`Sampler.rollout_groups` with one ``(seed, step,
        global group)`` generator per group (each group sampled as if alone; samplers may batch the groups).

        Call once per training step: it advances the sampler's per-step state.
        """
        begin_step(sampler, self.seed, step)
        (rollout,) = group_rollouts(sampler, policy, batch, self.seed, step, max(1, batch.num_groups))
        return rollout

    def rollout_parts(
        self, sampler: Sampler, policy: Policy, batch: PromptBatch, step: int, groups_per_part: int
    ) -> Iterator[Rollout]:
        """Step ``step``'s rollout in parts of ``groups_per_part`` groups (:func:`group_rollouts`, after
        :func:`begin_step`); merged, they equal :meth:`rollout` up to floating-point batch effects."""
        begin_step(sampler, self.seed, step)
        yield from group_rollouts(sampler, policy, batch, self.seed, step, groups_per_part)

    def minibatch_generator(self, step: int) -> torch.Generator:
        """A fresh generator for this step and rank."""
        return derived_generator(self.seed, STREAM_MINIBATCH, step, self.rank)

    def gather(self, rollout: Rollout, scores: RewardScores, guards: Guards) -> GroupView:
        """Gather the step's view and every rank's guard findings (so all ranks skip or stop together)."""
        view = gather_view(rollout, scores, self.rank, self._gather)
        if self.backend is not None:
            self.backend.loss_weight = view.loss_weight
        found = self._gather((dict(guards.counts), list(guards.problems)))
        guards.counts, guards.problems = {}, []
        for r, (counts, problems) in enumerate(found):
            for key, value in counts.items():
                guards.counts[key] = guards.counts.get(key, 0.0) + value
            guards.problems.extend(f"rank {r}: {p}" for p in problems)
        return view

    def reduce(self, update: UpdateTotals) -> UpdateTotals:
        """Combine every rank's update (:func:`reduce_updates`)."""
        return reduce_updates(self._gather(update))

    def max_over_ranks(self, value: float) -> float:
        """The largest of every rank's ``value`` (a collective: every rank must call it)."""
        return max(float(v) for v in self._gather(float(value)))

    def barrier(self) -> None:
        """Wait for every rank."""
        self._barrier()
