"""Registers the components shared by several algorithms (a core plugin, like pytest's default plugins)."""

from __future__ import annotations

from typing import Any

from rlpost.components.clipped_surrogate import ClippedSurrogate
from rlpost.components.group_zscore import GroupZScoreAdvantage
from rlpost.core.hookspecs import hookimpl


@hookimpl
def rlpost_register_optimizers(register: Any) -> None:
    """Register the clipped-surrogate update rule."""
    register(ClippedSurrogate)


@hookimpl
def rlpost_register_advantage_estimators(register: Any) -> None:
    """Register the group z-score estimator shared by DanceGRPO and MixGRPO."""
    register(GroupZScoreAdvantage)
