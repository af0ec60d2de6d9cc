"""AWM (Advantage Weighted Matching) for rlpost: the likelihood-free update rule ``awm``.

Registered through the ``rlpost`` entry-point group (``awm = "rlpost_awm"``). See ``docs/algorithms/awm.md``.
"""

from __future__ import annotations

from rlpost import PolicyOptimizer, Registry, hookimpl


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register :class:`~rlpost_awm.update.AWMUpdate` (``awm``)."""
    from .update import AWMUpdate

    register(AWMUpdate)
