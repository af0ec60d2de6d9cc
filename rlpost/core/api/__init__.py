"""Component interfaces: what a sampler, advantage estimator, reward source, policy-update rule, policy model and
prompt source must provide.

These are small abstract base classes rather than ``typing.Protocol`` because jsonargparse resolves recipe
``class_path`` short names among *subclasses* of the declared type; they hold no implementation to inherit
(torchtune's "no implementation inheritance" rule), only the contract, the self-naming ``name`` and the
capability sets used by ``rlpost validate``.

Every component names itself with a kebab-case ``name`` (used in recipes, logs and manifests). Samplers declare
``provides`` (e.g. ``{"edge-log-probs", "tree"}``), estimators and update rules declare ``requires``
(:mod:`rlpost.core.api.capabilities`); a recipe pairing either with a sampler that does not provide what it requires is
rejected before any model loads.
"""

from __future__ import annotations

from collections.abc import Iterator

from rlpost.core.api.advantage import AdvantageEstimator, Advantages
from rlpost.core.api.arguments import InvalidArguments, Range
from rlpost.core.api.capabilities import (
    CHAINS,
    CLEAN_SAMPLES,
    EDGE_LOG_PROBS,
    EDGE_OLD_MEANS,
    TREE,
    missing_capabilities,
)
from rlpost.core.api.component import Component
from rlpost.core.api.copies import LIVE, REFERENCE, WeightCopies
from rlpost.core.api.hub import GATED_HINT, HubFiles
from rlpost.core.api.policy import Conditioning, Policy, resolve_guidance
from rlpost.core.api.prompts import PromptSource
from rlpost.core.api.reward import MediaScope, RewardSource
from rlpost.core.api.sampler import EdgeEval, Sampler, StepCounts
from rlpost.core.api.update import (
    PolicyOptimizer,
    TrainBackend,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    update_result_problems,
)

__all__ = [
    "CHAINS",
    "CLEAN_SAMPLES",
    "EDGE_LOG_PROBS",
    "EDGE_OLD_MEANS",
    "LIVE",
    "REFERENCE",
    "TREE",
    "AdvantageEstimator",
    "Advantages",
    "Component",
    "Conditioning",
    "EdgeEval",
    "GATED_HINT",
    "HubFiles",
    "InvalidArguments",
    "MediaScope",
    "Policy",
    "PolicyOptimizer",
    "PromptSource",
    "Range",
    "RewardSource",
    "Sampler",
    "StepCounts",
    "TrainBackend",
    "TrainCounts",
    "UpdateContext",
    "UpdateResult",
    "WeightCopies",
    "missing_capabilities",
    "resolve_guidance",
    "update_result_problems",
]


def iter_kinds() -> Iterator[type[Component]]:
    """The component base classes, in registry order."""
    yield from (Sampler, AdvantageEstimator, RewardSource, PolicyOptimizer, Policy, PromptSource)
