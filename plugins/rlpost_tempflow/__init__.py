"""TempFlow-GRPO for rlpost: the comb sampler, per-(prompt, step) advantages and the noise-weighted update rule
(He et al., arXiv 2508.04324).

Registered through the ``rlpost`` entry-point group (``tempflow = "rlpost_tempflow"``). See
``docs/algorithms/tempflow.md``.
"""

from __future__ import annotations

from rlpost import AdvantageEstimator, PolicyOptimizer, Registry, Sampler, hookimpl


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register the comb sampler (``tempflow``)."""
    from rlpost_tempflow.sampler import TempFlowSampler

    register(TempFlowSampler)


@hookimpl
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register the per-(prompt, step) normalisation (``tempflow``)."""
    from rlpost_tempflow.advantage import TempFlowAdvantage

    register(TempFlowAdvantage)


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register the noise-weighted clipped surrogate (``tempflow``)."""
    from rlpost_tempflow.update import TempFlowUpdate

    register(TempFlowUpdate)
