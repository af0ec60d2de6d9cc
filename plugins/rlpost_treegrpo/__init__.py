"""TreeGRPO for rlpost: the tree sampler and the leaf-to-root advantage backup (Ding & Ye, arXiv 2512.08153).

Registered through the ``rlpost`` entry-point group (``treegrpo = "rlpost_treegrpo"``). See
``docs/algorithms/treegrpo.md`` and this package's ``README.md``.
"""

from __future__ import annotations

from rlpost import AdvantageEstimator, Registry, Sampler, hookimpl


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register the tree sampler (``tree``)."""
    from rlpost_treegrpo.sampler import TreeSampler

    register(TreeSampler)


@hookimpl
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register the tree backup (``tree-backup``) and its no-backup ablation (``leaf-zscore``)."""
    from rlpost_treegrpo.advantage import LeafZScoreAdvantage, TreeBackupAdvantage

    register(TreeBackupAdvantage)
    register(LeafZScoreAdvantage)
