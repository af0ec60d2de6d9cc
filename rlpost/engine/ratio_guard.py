"""The speed-up guards, run before training whenever a speed-up is on (``run.speedups``; docs/speed.md), and the
ratio guard itself. Which guard a run gets follows what its update rule requires
(:mod:`rlpost.core.api.capabilities`): a rule that requires ``edge-log-probs`` gets the ratio guard below, any other
(a likelihood-free rule) the loss guard (:mod:`rlpost.engine.loss_guard`).

The ratio guard: a rollout re-evaluated by the training path must give importance ratio 1 within
``run.speedups.ratio_tolerance``, else the run refuses to start. A speed-up may compute the rollout's velocities
differently from the training forward (compiled or eager kernels, autocast on one path only, another attention
kernel). The clipped surrogate's ratio ``exp(log π_θ - log π_old)`` is then not 1 for an unchanged policy, and with PPO
clip ranges of 1e-4 an error of that size already clips the first update (Flow-Factory, X-GenGroup/Flow-Factory,
blocks lossy speed-ups for ratio-based methods for this reason). :func:`check_speedups` draws one rollout of
``run.speedups.guard_groups`` prompt groups from the recipe's sampler, evaluates its trainable edges exactly as the
update does (``Sampler.evaluate`` with gradients enabled, the policy in train mode, minibatches of at most the update
rule's ``minibatch_edges`` edges, a parent's edges together) and compares ``exp(new - old)`` with 1. A rollout with no
trainable edge of finite log-prob leaves nothing to measure, and the run is refused rather than passed unchecked.

Either guard leaves the run as it found it, so whether it ran changes none of the run's results: the sampler and the
prompt stream are deep copies, the rollout draws from a generator of its own (stream ``STREAM_GUARD``) under the
weight copy the run's first rollout uses, the global RNG states are restored, and the policy's prompt cache is
cleared again (the runner calls it at the end of ``setup``, before anything was encoded). What it does leave is
useful: compiled code for the first step's shapes and the policy's ``forward_count`` (readers take differences
across steps).
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor

from rlpost.components.clipped_surrogate import parent_aligned_chunks
from rlpost.components.prompts import PromptStream
from rlpost.core.api import EDGE_LOG_PROBS, LIVE, Policy, Sampler, WeightCopies
from rlpost.core.contract import Rollout
from rlpost.engine.loss_guard import LossCheck, LossGuardEmptyError, SpeedupLossError, measure_loss
from rlpost.engine.recipe import Recipe, RecipeError
from rlpost.engine.sharding import STREAM_GUARD, derived_generator
from rlpost.models.acceleration import Accelerable

__all__ = [
    "RatioCheck",
    "RatioGuardEmptyError",
    "SpeedupCheck",
    "SpeedupRatioError",
    "check_speedups",
    "training_path_ratios",
]


@dataclass(frozen=True)
class RatioCheck:
    """What the guard measured.

    Attributes:
        speedups: The speed-ups that were on (``AccelerateConfig.enabled()``).
        max_error: ``max |ratio - 1|`` over the checked edges (the largest over ranks).
        mean_error: Mean ``|ratio - 1|`` (this rank's).
        edges: Trainable edges checked.
        tolerance: ``run.speedups.ratio_tolerance``.
        seconds: Wall time of the check (rollout, re-evaluation and any compilation they triggered).
    """

    speedups: tuple[str, ...]
    max_error: float
    mean_error: float
    edges: int
    tolerance: float
    seconds: float

    @property
    def passed(self) -> bool:
        """Whether the error is within the tolerance."""
        return self.max_error <= self.tolerance

    def metrics(self) -> dict[str, float]:
        """The step metrics that carry the measurement into ``metrics.jsonl``, ``summary.json`` and the bench."""
        return {
            "accelerate/ratio_error": self.max_error,
            "accelerate/ratio_error_mean": self.mean_error,
            "accelerate/guard_sec": self.seconds,
        }

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self) | {"speedups": list(self.speedups), "passed": self.passed}


class SpeedupRatioError(RecipeError):
    """The speed-ups change the importance ratio by more than ``run.speedups.ratio_tolerance`` (a recipe problem:
    ``rlpost train`` exits with status 2 before the first step)."""

    def __init__(self, check: RatioCheck) -> None:
        self.check = check
        super().__init__(
            [
                f"run.speedups: the speed-ups {list(check.speedups)} change the importance ratio of a rollout "
                f"re-evaluated by the training path: max |ratio - 1| = {check.max_error:.3g} over {check.edges} "
                f"trainable edges > run.speedups.ratio_tolerance = {check.tolerance:g}. Turn off the speed-up that "
                "treats the rollout and the update differently (a one-path autocast_scope, compile on one path in "
                "low precision, ...) or, knowingly, raise ratio_tolerance"
            ]
        )


class RatioGuardEmptyError(RecipeError):
    """The guard's rollout has no trainable edge with a finite log-prob, so the ratio guard had nothing to measure
    (exit status 2, like any recipe problem: a guard that passed on nothing would let any speed-up through)."""

    def __init__(self, sampler: Sampler, rollout: Rollout, speedups: tuple[str, ...]) -> None:
        trainable = int(rollout.trainable.sum())
        why = (
            f"it marked none of its {rollout.num_edges} edge(s) trainable"
            if trainable == 0
            else f"none of its {trainable} trainable edge(s) has a finite old log-prob"
        )
        super().__init__(
            [
                f"run.speedups: the ratio guard has nothing to measure: the guard's rollout of {rollout.num_groups} "
                f"group(s) has no trainable edge with a finite log-prob (sampler {sampler.name!r}: {why} for this "
                f"draw), so the speed-ups {list(speedups)} cannot be checked. Raise run.speedups.guard_groups, or "
                "turn the speed-ups off"
            ]
        )


SpeedupCheck: TypeAlias = RatioCheck | LossCheck
"""What either guard measured (``Runner.ratio_check``): both give ``passed``, ``metrics()`` and ``as_dict()``."""


def training_path_ratios(policy: Policy, sampler: Sampler, rollout: Rollout, minibatch_edges: int) -> Tensor:
    """``[E]`` fp64 ratios ``exp(new - old)`` of the rollout's trainable edges with finite old log-probs, evaluated as
    the update does: ``sampler.evaluate`` with gradients, the policy in train mode, at most ``minibatch_edges`` edges
    per call (``0``: all at once) and a parent's edges together (:func:`parent_aligned_chunks`). No backward runs."""
    trainable = torch.nonzero(rollout.trainable, as_tuple=False).flatten()
    edges = trainable[torch.isfinite(rollout.old_log_probs[trainable])]
    if edges.numel() == 0:
        return torch.empty(0, dtype=torch.float64)
    parents = rollout.edge_parent[edges]
    chunks = max(1, math.ceil(edges.numel() / minibatch_edges)) if minibatch_edges > 0 else 1
    out = []
    policy.train(True)
    try:
        with torch.enable_grad():
            for pos in parent_aligned_chunks(parents, chunks):
                mb = edges[pos]
                new = sampler.evaluate(policy, rollout, mb).log_prob.detach()
                old = rollout.old_log_probs[mb].to(new.device, torch.float64)
                out.append(torch.exp(new.to(torch.float64) - old).cpu())
    finally:
        policy.train(False)
    return torch.cat(out)


def check_speedups(
    recipe: Recipe,
    stream: PromptStream,
    seed: int,
    step: int,
    max_over_ranks: Any = None,
    copies: WeightCopies | None = None,
) -> SpeedupCheck | None:
    """Run the guard the update rule calls for when a speed-up is on (``None`` otherwise) and refuse the run when it
    fails: the ratio guard for a rule that requires ``edge-log-probs``, the loss guard for any other.

    Args:
        recipe: The run's recipe; its model is set up and accelerated.
        stream: The run's prompt stream (copied, never advanced).
        seed: The run's seed (the guard's own generators derive from it).
        step: The step training starts at (a resumed run's; the sampler's per-step state is drawn for it).
        max_over_ranks: ``float -> float`` taking the largest value over ranks (``GroupSharding.max_over_ranks``) so
            every rank decides alike; ``None`` in one process.
        copies: The run's weight copies (the rollout runs under ``rollout_copy(step)``, the loss guard's update
            evaluates the copies the rule uses); ``None``: the live weights and the frozen reference only.

    Raises:
        SpeedupRatioError: ``max |ratio - 1| > run.speedups.ratio_tolerance``, naming the speed-ups and the error.
        RatioGuardEmptyError: The ratio guard's rollout has no trainable edge with a finite log-prob.
        SpeedupLossError: The loss with the speed-ups differs from the loss without by more than
            ``run.speedups.loss_tolerance``, relatively.
        LossGuardEmptyError: The update rule passed no loss to ``backward`` on the guard's rollout.
    """
    settings = recipe.run.speedups
    speedups = tuple(settings.enabled())
    if not speedups:
        return None
    policy, rule = recipe.model, recipe.optimizer
    t0 = time.perf_counter()
    sampler = copy.deepcopy(recipe.sampler)
    batch = copy.deepcopy(stream).next_batch(settings.guard_groups, recipe.run.samples_per_group)
    weights = rule.rollout_copy(step) or LIVE
    ratio_guard = EDGE_LOG_PROBS in rule.requires
    device = policy.device
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        sampler.begin_step(step, derived_generator(seed, STREAM_GUARD, step, 1))
        with torch.no_grad(), copies.use(weights) if copies is not None else nullcontext():
            rollout = sampler.rollout(policy, batch, derived_generator(seed, STREAM_GUARD, step, 0))
        if ratio_guard:
            ratios = training_path_ratios(policy, sampler, rollout, int(rule.minibatch_edges))
        else:
            measured = measure_loss(rule, policy, sampler, rollout, copies, seed, step)
    if isinstance(policy, Accelerable):
        policy.clear_prompt_cache()
    if not ratio_guard:
        loss, reference, error, losses = measured
        if losses == 0:
            raise LossGuardEmptyError(rule.name, rollout.num_groups, speedups)
        loss_check = LossCheck(
            speedups=speedups,
            loss=loss,
            reference_loss=reference,
            error=float(max_over_ranks(error)) if max_over_ranks is not None else error,
            losses=losses,
            tolerance=float(settings.loss_tolerance),
            seconds=time.perf_counter() - t0,
        )
        if not loss_check.passed:
            raise SpeedupLossError(loss_check)
        return loss_check
    if ratios.numel() == 0:  # every rank checks the same rollout, so every rank refuses alike
        raise RatioGuardEmptyError(sampler, rollout, speedups)
    errors = (ratios - 1).abs()
    local_max = float(errors.max())
    check = RatioCheck(
        speedups=speedups,
        max_error=float(max_over_ranks(local_max)) if max_over_ranks is not None else local_max,
        mean_error=float(errors.mean()),
        edges=int(errors.numel()),
        tolerance=float(settings.ratio_tolerance),
        seconds=time.perf_counter() - t0,
    )
    if not check.passed:  # a NaN error fails too: it is not <= the tolerance
        raise SpeedupRatioError(check)
    return check
