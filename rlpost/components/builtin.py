"""Registers the components shared by several algorithms (a core plugin, like pytest's default plugins)."""

from __future__ import annotations

from rlpost.components.clipped_surrogate import ClippedSurrogate
from rlpost.components.group_zscore import GroupZScoreAdvantage
from rlpost.core.api import AdvantageEstimator, PolicyOptimizer
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register the clipped-surrogate update rule."""
    register(ClippedSurrogate)


@hookimpl
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register the group z-score estimator shared by DanceGRPO and MixGRPO."""
    register(GroupZScoreAdvantage)
