"""rlpost: online RL post-training of text-to-image flow-matching models.

Plugins import :data:`hookimpl` and the component base classes from here::

    from rlpost import hookimpl, RewardSource
"""

from __future__ import annotations

from rlpost.core.api import (
    AdvantageEstimator,
    Advantages,
    Conditioning,
    EdgeEval,
    Policy,
    PolicyOptimizer,
    PromptSource,
    RewardSource,
    Sampler,
    StepCounts,
    TrainBackend,
    UpdateContext,
)
from rlpost.core.contract import PromptBatch, RewardScores, Rollout, Stash, StashKey
from rlpost.core.hookspecs import hookimpl

__all__ = [
    "AdvantageEstimator",
    "Advantages",
    "Conditioning",
    "EdgeEval",
    "Policy",
    "PolicyOptimizer",
    "PromptBatch",
    "PromptSource",
    "RewardScores",
    "RewardSource",
    "Rollout",
    "Sampler",
    "Stash",
    "StashKey",
    "StepCounts",
    "TrainBackend",
    "UpdateContext",
    "__version__",
    "hookimpl",
]


def __getattr__(name: str) -> str:
    # Resolve the version lazily from the installed metadata (pluggy's pattern): importing rlpost stays cheap.
    if name == "__version__":
        import importlib.metadata

        try:
            return importlib.metadata.version("rlpost")
        except importlib.metadata.PackageNotFoundError:
            return "0+unknown"
    raise AttributeError(name)
