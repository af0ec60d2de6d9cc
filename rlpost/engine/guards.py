"""Non-finite guards: rewards, advantages, log-probs, losses and gradients are checked where they arise.

The recipe's ``guards.on_nonfinite`` decides what happens (``docs/design.md``, "Guards"):

* ``skip``: the offending sample or step is left out and counted (``guard/nonfinite_<what>``); training continues.
  Non-finite rewards skip the whole step's update (advantages of a group would otherwise be poisoned); non-finite
  advantages or behaviour log-probs mark their edges untrainable; a non-finite loss never reaches ``backward`` and a
  non-finite gradient never reaches the weights (both already enforced by the update rule and the backend).
* ``stop``: the runner saves a checkpoint (weights are finite: nothing non-finite was applied) and raises
  :class:`NonFiniteError` naming what and where.

A reward plugin that raises or returns the wrong length or type is handled the same way (:meth:`Guards.plugin_failed`):
with ``skip`` the step's update is skipped and counted under ``guard/plugin_failures``; with ``stop`` the checkpoint
is saved and the run fails with :class:`rlpost.core.plugin_errors.PluginRuntimeError` naming the distribution and
reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlpost.core.plugin_errors import PluginRuntimeError

__all__ = ["GuardConfig", "Guards", "NonFiniteError"]

OnNonFinite = Literal["skip", "stop"]


class NonFiniteError(FloatingPointError):
    """A non-finite value was found and ``guards.on_nonfinite`` is ``stop``."""


@dataclass
class GuardConfig:
    """Recipe section ``guards``.

    Attributes:
        on_nonfinite: ``stop`` (save a checkpoint, then fail with a clear error) or ``skip`` (leave the sample or
            step out, count it under ``guard/*`` and continue).
        max_skipped_steps: With ``skip``, stop anyway after this many steps had something skipped (0 = never).
    """

    on_nonfinite: OnNonFinite = "stop"
    max_skipped_steps: int = 0

    def problems(self) -> list[str]:
        """Range problems, each naming its field relative to the section (the recipe prefixes ``guards.``)."""
        n = self.max_skipped_steps
        return [f"max_skipped_steps: must be >= 0, got {n}"] if n < 0 else []


class Guards:
    """Per-step non-finite bookkeeping.

    Args:
        config: The recipe's guard settings.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.counts: dict[str, float] = {}
        self.problems: list[str] = []
        self.skipped_steps = 0
        self.plugin_errors: list[PluginRuntimeError] = []

    def begin_step(self) -> None:
        """Reset the per-step counters."""
        self.counts = {}
        self.problems = []
        self.plugin_errors = []

    def plugin_failed(self, error: PluginRuntimeError) -> None:
        """Count a plugin component that failed this step (its step's update must be skipped)."""
        self.counts["guard/plugin_failures"] = self.counts.get("guard/plugin_failures", 0.0) + 1.0
        self.problems.append(str(error))
        self.plugin_errors.append(error)

    def record(self, what: str, count: int, where: str) -> None:
        """Count ``count`` non-finite ``what`` values (``reward``, ``advantage``, ``logprob``, ``loss``, ``grad``)."""
        if count <= 0:
            return
        self.counts[f"guard/nonfinite_{what}"] = self.counts.get(f"guard/nonfinite_{what}", 0.0) + float(count)
        self.problems.append(f"{count} non-finite {what} value(s) in {where}")

    def finite_mask(self, what: str, values: Tensor, where: str) -> Tensor:
        """Record the non-finite entries of ``values`` and return the finite mask (rows reduced over the rest)."""
        finite = torch.isfinite(values.detach())
        if finite.ndim > 1:
            finite = finite.flatten(1).all(dim=1)
        self.record(what, int((~finite).sum()), where)
        return finite

    @property
    def tripped(self) -> bool:
        """Whether anything non-finite was seen this step."""
        return bool(self.problems)

    def metrics(self) -> dict[str, float]:
        """``guard/*`` counters of this step (every known counter, zeros included, so dashboards show flat lines)."""
        out = {f"guard/nonfinite_{w}": 0.0 for w in ("reward", "advantage", "logprob", "loss", "grad")}
        out["guard/plugin_failures"] = 0.0
        out.update(self.counts)
        out["guard/skipped_steps"] = float(self.skipped_steps)
        return out

    def should_stop(self) -> bool:
        """Apply the policy at the end of a step: True when the run must stop (after saving a checkpoint)."""
        if not self.tripped:
            return False
        if self.config.on_nonfinite == "stop":
            return True
        self.skipped_steps += 1
        limit = self.config.max_skipped_steps
        return limit > 0 and self.skipped_steps >= limit

    def error(self, step: int) -> NonFiniteError | PluginRuntimeError:
        """The error to raise when :meth:`should_stop` said so (a plugin failure first: it names the plugin)."""
        policy = self.config.on_nonfinite
        why = "" if policy == "stop" else f" (guards.max_skipped_steps={self.config.max_skipped_steps} reached)"
        if self.plugin_errors:
            first = self.plugin_errors[0]
            error = PluginRuntimeError(
                first.distribution,
                first.plugin,
                first.where,
                f"{first.problem} (step {step}; guards.on_nonfinite={policy}{why}: a checkpoint of the last good "
                "weights was saved; set guards.on_nonfinite: skip to skip such steps instead)",
            )
            error.__cause__ = first.__cause__  # what the plugin raised, with its traceback
            return error
        return NonFiniteError(
            f"step {step}: " + "; ".join(self.problems) + f". guards.on_nonfinite={policy}{why}: a checkpoint of the "
            "last finite weights was saved; set guards.on_nonfinite: skip to leave such samples/steps out instead"
        )
