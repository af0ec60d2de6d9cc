"""The ratio guard: with a speed-up on (``run.accelerate``), a rollout re-evaluated by the training path must give
importance ratio 1 within ``run.accelerate.ratio_tolerance``, else the run refuses to start (docs/speed.md).

A speed-up may compute the rollout's velocities differently from the training forward (compiled or eager kernels,
autocast on one path only, another attention kernel). The clipped surrogate's ratio ``exp(log π_θ - log π_old)`` is
then not 1 for an unchanged policy, and with PPO clip ranges of 1e-4 an error of that size already clips the first
update (Flow-Factory, X-GenGroup/Flow-Factory, blocks lossy speed-ups for ratio-based methods for this reason).
:func:`check_speedups` draws one rollout of ``run.accelerate.guard_groups`` prompt groups from the
recipe's sampler, evaluates its trainable edges exactly as the update does (``Sampler.evaluate`` with gradients
enabled, the policy in train mode, minibatches of at most the update rule's ``minibatch_edges`` edges, a parent's
edges together) and compares ``exp(new - old)`` with 1.

It leaves the run as it found it, so whether the guard ran changes none of the run's results: the sampler and the
prompt stream are deep copies, the rollout draws from a generator of its own (stream ``STREAM_GUARD``), the global
RNG states are restored, and the policy's prompt cache is cleared again (the runner calls it at the end of
``setup``, before anything was encoded). What it does leave is useful: compiled code for the first step's shapes and
the policy's ``forward_count`` (readers take differences across steps).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from rlpost.components.clipped_surrogate import parent_aligned_chunks
from rlpost.components.prompts import PromptStream
from rlpost.core.api import Policy, Sampler
from rlpost.core.contract import Rollout
from rlpost.engine.recipe import Recipe, RecipeError
from rlpost.engine.sharding import STREAM_GUARD, derived_generator
from rlpost.models.acceleration import Accelerable

__all__ = ["RatioCheck", "SpeedupRatioError", "check_speedups", "training_path_ratios"]


@dataclass(frozen=True)
class RatioCheck:
    """What the guard measured.

    Attributes:
        speedups: The speed-ups that were on (``AccelerateConfig.enabled()``).
        max_error: ``max |ratio - 1|`` over the checked edges (the largest over ranks).
        mean_error: Mean ``|ratio - 1|`` (this rank's).
        edges: Trainable edges checked.
        tolerance: ``run.accelerate.ratio_tolerance``.
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
    """The speed-ups change the importance ratio by more than ``run.accelerate.ratio_tolerance`` (a recipe problem:
    ``rlpost train`` exits with status 2 before the first step)."""

    def __init__(self, check: RatioCheck) -> None:
        self.check = check
        super().__init__(
            [
                f"run.accelerate: the speed-ups {list(check.speedups)} change the importance ratio of a rollout "
                f"re-evaluated by the training path: max |ratio - 1| = {check.max_error:.3g} over {check.edges} "
                f"trainable edges > run.accelerate.ratio_tolerance = {check.tolerance:g}. Turn off the speed-up that "
                "treats the rollout and the update differently (a one-path autocast_scope, compile on one path in "
                "low precision, ...) or, knowingly, raise ratio_tolerance"
            ]
        )


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
) -> RatioCheck | None:
    """Run the guard when a speed-up is on (``None`` otherwise) and refuse the run when it fails.

    Args:
        recipe: The run's recipe; its model is set up and accelerated.
        stream: The run's prompt stream (copied, never advanced).
        seed: The run's seed (the guard's own generators derive from it).
        step: The step training starts at (a resumed run's; the sampler's per-step state is drawn for it).
        max_over_ranks: ``float -> float`` taking the largest value over ranks (``GroupSharding.max_over_ranks``) so
            every rank decides alike; ``None`` in one process.

    Raises:
        SpeedupRatioError: ``max |ratio - 1| > run.accelerate.ratio_tolerance``, naming the speed-ups and the error.
    """
    settings = recipe.run.accelerate
    speedups = tuple(settings.enabled())
    if not speedups:
        return None
    policy = recipe.model
    t0 = time.perf_counter()
    sampler = copy.deepcopy(recipe.sampler)
    batch = copy.deepcopy(stream).next_batch(settings.guard_groups, recipe.run.samples_per_group)
    device = policy.device
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        sampler.begin_step(step, derived_generator(seed, STREAM_GUARD, step, 1))
        with torch.no_grad():
            rollout = sampler.rollout(policy, batch, derived_generator(seed, STREAM_GUARD, step, 0))
        ratios = training_path_ratios(policy, sampler, rollout, int(recipe.optimizer.minibatch_edges))
    if isinstance(policy, Accelerable):
        policy.clear_prompt_cache()
    errors = (ratios - 1).abs()
    local_max = float(errors.max()) if errors.numel() else 0.0
    check = RatioCheck(
        speedups=speedups,
        max_error=float(max_over_ranks(local_max)) if max_over_ranks is not None else local_max,
        mean_error=float(errors.mean()) if errors.numel() else 0.0,
        edges=int(errors.numel()),
        tolerance=float(settings.ratio_tolerance),
        seconds=time.perf_counter() - t0,
    )
    if not check.passed:  # a NaN error fails too: it is not <= the tolerance
        raise SpeedupRatioError(check)
    return check
