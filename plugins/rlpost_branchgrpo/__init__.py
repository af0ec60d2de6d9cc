"""BranchGRPO for rlpost: the branching sampler, fused per-depth advantages and the per-tree-scaled surrogate
(Li et al., arXiv 2509.06040; ``Fredreic1849/BranchGRPO``).

Registered through the ``rlpost`` entry-point group (``branchgrpo = "rlpost_branchgrpo"``). See
``docs/algorithms/branchgrpo.md``.
"""

from __future__ import annotations

from rlpost import AdvantageEstimator, PolicyOptimizer, Registry, Sampler, hookimpl


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register the branching sampler (``branch``)."""
    from rlpost_branchgrpo.sampler import BranchSampler

    register(BranchSampler)


@hookimpl
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register the fused per-depth estimator (``branch-fusion``)."""
    from rlpost_branchgrpo.advantage import BranchFusionAdvantage

    register(BranchFusionAdvantage)


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register the per-tree-scaled clipped surrogate (``branch-surrogate``)."""
    from rlpost_branchgrpo.update import BranchSurrogate

    register(BranchSurrogate)
