"""DGPO for rlpost: Direct Group Preference Optimization (Luo, Hu, Tang, arXiv 2510.08425) as a likelihood-free
update rule on the clean samples of an ODE rollout.

Registered through the ``rlpost`` entry-point group (``dgpo = "rlpost_dgpo"``). See ``docs/algorithms/dgpo.md``.
"""

from __future__ import annotations

from rlpost import PolicyOptimizer, Registry, hookimpl


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register :class:`~rlpost_dgpo.update.DGPOUpdate` (``dgpo``)."""
    from .update import DGPOUpdate

    register(DGPOUpdate)
