"""The loss guard: with a speed-up on (``run.speedups``) and a likelihood-free update rule, one batch's loss computed
with the speed-ups must equal the loss computed without them within ``run.speedups.loss_tolerance`` (relative), else
the run refuses to start (docs/speed.md, "The loss guard").

A likelihood-free rule (DiffusionNFT, AWM, DGPO: it does not require ``edge-log-probs``) has no importance ratio for
the ratio guard to measure: it re-noises the rollout's clean samples and regresses the live velocity (and copies') on
them. What a speed-up can change is that loss, through the velocities of the training path (compiled kernels, bf16
autocast) and of the weight copies the rule evaluates without gradients. :func:`measure_loss` runs the rule's own
``update`` twice on the guard's rollout, once as the run will (speed-ups on) and once with every transformer call
bypassing them (:meth:`~rlpost.models.acceleration.Accelerable.without_speedups`), and compares the losses it passes
to ``backward``:

* the rule is a deep copy each time, so state it keeps is not advanced;
* its backend is a :class:`RecordingBackend`: ``backward`` records the loss and computes no gradient, ``step`` does
  nothing, so the weights never change;
* the advantages are synthetic (:func:`synthetic_advantages`: within-group z-scores of each sample's place in its
  group), since the comparison needs no reward;
* both calls see the same minibatch generator, the same run seed and step (so the same keyed noise draws,
  ``rlpost.ops.training_noise``) and the same global RNG state (each call runs under ``torch.random.fork_rng``).

The error is ``|L_fast - L_plain| / |L_plain|`` of the losses summed over the ``backward`` calls. Advantage-weighted
terms of opposite signs partly cancel in that sum, which magnifies the relative error: the guard then errs towards
refusing, and ``loss_tolerance`` can be raised knowingly. A speed-up that changes which losses are finite, or how many
reach ``backward``, is refused outright (infinite error).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from rlpost.core.api import Advantages, Policy, PolicyOptimizer, Sampler, TrainBackend, UpdateContext, WeightCopies
from rlpost.core.contract import Rollout
from rlpost.engine.recipe import RecipeError
from rlpost.engine.sharding import STREAM_GUARD, derived_generator
from rlpost.models.acceleration import Accelerable

__all__ = [
    "LossCheck",
    "LossGuardEmptyError",
    "RecordingBackend",
    "SpeedupLossError",
    "measure_loss",
    "synthetic_advantages",
]


class RecordingBackend(TrainBackend):
    """A backend that records the losses an update passes to :meth:`backward` and trains nothing: no gradient is
    computed and :meth:`step` leaves the weights alone.

    Attributes:
        losses: ``float(loss)`` of every ``backward`` call, in order (non-finite ones too).
        steps: ``step`` calls.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps = 0

    def backward(self, loss: Tensor) -> None:
        self.losses.append(float(loss.detach().float().sum()))

    def step(self) -> dict[str, float]:
        self.steps += 1
        return {}


def synthetic_advantages(rollout: Rollout) -> Advantages:
    """Per sample: the z-score of its place within its group (``1`` in a group of one sample); edges: 0.

    Non-zero, of both signs, with no reward involved: what a likelihood-free rule's loss needs to be a realistic,
    non-trivial function of the weights."""
    groups = rollout.sample_group.cpu()
    samples = torch.ones(rollout.num_samples)
    for g in torch.unique(groups):
        rows = torch.nonzero(groups == g, as_tuple=False).flatten()
        if rows.numel() > 1:
            place = torch.arange(rows.numel(), dtype=torch.float32)
            samples[rows] = (place - place.mean()) / place.std()
    return Advantages(edges=torch.zeros(rollout.num_edges), samples=samples)


@dataclass(frozen=True)
class LossCheck:
    """What the loss guard measured.

    Attributes:
        speedups: The speed-ups that were on (``AccelerateConfig.enabled()``).
        loss: The summed loss with the speed-ups.
        reference_loss: The summed loss without them.
        error: ``|loss - reference_loss| / |reference_loss|`` (the largest over ranks; ``inf`` when the two passed
            different numbers of losses to ``backward`` or found different numbers non-finite).
        losses: ``backward`` calls per pass.
        tolerance: ``run.speedups.loss_tolerance``.
        seconds: Wall time of the check (rollout, both updates and any compilation they triggered).
    """

    speedups: tuple[str, ...]
    loss: float
    reference_loss: float
    error: float
    losses: int
    tolerance: float
    seconds: float

    @property
    def passed(self) -> bool:
        """Whether the error is within the tolerance (a NaN error is not)."""
        return self.error <= self.tolerance

    def metrics(self) -> dict[str, float]:
        """The step metrics that carry the measurement into ``metrics.jsonl`` and ``summary.json``."""
        return {"accelerate/loss_error": self.error, "accelerate/guard_sec": self.seconds}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self) | {"speedups": list(self.speedups), "passed": self.passed}


class SpeedupLossError(RecipeError):
    """The speed-ups change a likelihood-free rule's loss by more than ``run.speedups.loss_tolerance`` (a recipe
    problem: ``rlpost train`` exits with status 2 before the first step)."""

    def __init__(self, check: LossCheck) -> None:
        self.check = check
        super().__init__(
            [
                f"run.speedups: the speed-ups {list(check.speedups)} change the update rule's loss on one batch: "
                f"{check.loss:.6g} with them, {check.reference_loss:.6g} without (relative error {check.error:.3g} "
                f"over {check.losses} loss(es)) > run.speedups.loss_tolerance = {check.tolerance:g}. Turn off the "
                "speed-up that changes the training path's numerics (autocast on the train path, compile in low "
                "precision, ...) or, knowingly, raise loss_tolerance"
            ]
        )


class LossGuardEmptyError(RecipeError):
    """The update rule passed no loss to ``backward`` on the guard's rollout, so the loss guard had nothing to
    compare (exit status 2, like any recipe problem)."""

    def __init__(self, rule: str, groups: int, speedups: tuple[str, ...]) -> None:
        super().__init__(
            [
                f"run.speedups: the loss guard has nothing to measure: update() of optimizer {rule!r} passed no "
                f"loss to backward on the guard's rollout of {groups} group(s), so the speed-ups {list(speedups)} "
                "cannot be checked; raise run.speedups.guard_groups or turn the speed-ups off"
            ]
        )


@dataclass(frozen=True)
class _Pass:
    losses: list[float]
    nonfinite: int

    @property
    def total(self) -> float:
        return math.fsum(self.losses)


def _update_once(
    rule: PolicyOptimizer,
    policy: Policy,
    sampler: Sampler,
    rollout: Rollout,
    copies: WeightCopies | None,
    seed: int,
    step: int,
) -> _Pass:
    """One update of a fresh deep copy of ``rule`` through a :class:`RecordingBackend`, the global RNG forked."""
    backend = RecordingBackend()
    ctx = UpdateContext(
        policy,
        sampler,
        rollout,
        synthetic_advantages(rollout),
        backend,
        derived_generator(seed, STREAM_GUARD, step, 2),
        step,
        copies,
        seed,
    )
    device = policy.device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        result = copy.deepcopy(rule).update(ctx)
    nonfinite = getattr(result, "nonfinite_losses", 0)
    return _Pass(backend.losses, int(nonfinite) if isinstance(nonfinite, int) else 0)


def measure_loss(
    rule: PolicyOptimizer,
    policy: Policy,
    sampler: Sampler,
    rollout: Rollout,
    copies: WeightCopies | None,
    seed: int,
    step: int,
) -> tuple[float, float, float, int]:
    """``rule``'s loss on ``rollout`` with the speed-ups and without them: ``(loss, reference_loss, error, losses)``
    (module docstring). Weights, ``rule`` and the global RNG states are as before.

    Raises:
        TypeError: ``policy`` cannot bypass its speed-ups (it is not :class:`~rlpost.models.acceleration.Accelerable`;
            ``rlpost validate`` refuses speed-ups on such a policy before this runs).
    """
    if not isinstance(policy, Accelerable):
        raise TypeError(f"the loss guard needs a policy that can bypass its speed-ups, got {type(policy).__name__}")
    fast = _update_once(rule, policy, sampler, rollout, copies, seed, step)
    with policy.without_speedups():
        plain = _update_once(rule, policy, sampler, rollout, copies, seed, step)
    if len(fast.losses) != len(plain.losses) or fast.nonfinite != plain.nonfinite:
        error = math.inf
    elif plain.total != 0:
        error = abs(fast.total - plain.total) / abs(plain.total)
    else:
        error = 0.0 if fast.total == 0 else math.inf
    if not (math.isfinite(fast.total) and math.isfinite(plain.total)):
        error = math.nan  # fails the guard: NaN is not within any tolerance
    return fast.total, plain.total, error, len(plain.losses)
