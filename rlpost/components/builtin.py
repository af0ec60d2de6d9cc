"""Registers the components shared by several algorithms (a core plugin, like pytest's default plugins)."""

from __future__ import annotations

from rlpost.components.clipped_surrogate import ClippedSurrogate
from rlpost.components.group_zscore import GroupZScoreAdvantage
from rlpost.components.solver_sampler import SolverSampler
from rlpost.core.api import AdvantageEstimator, PolicyOptimizer, Sampler
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register the ODE/band-SDE rollout sampler of the likelihood-free update rules (DiffusionNFT, AWM, DGPO)."""
    register(SolverSampler)


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register the clipped-surrogate update rule."""
    register(ClippedSurrogate)


@hookimpl
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register the group z-score estimator shared by DanceGRPO and MixGRPO."""
    register(GroupZScoreAdvantage)
