"""Flow-GRPO for rlpost (Liu et al., arXiv 2505.05470): the ``flow-grpo`` sampler (Flow-SDE or CPS chains, with
Flow-GRPO-Fast's SDE window as a preset), the ``flow-grpo`` update rule (clipped surrogate, KL over ``2 s_t²``,
GRPO-Guard's ratio normalisation as an option, arXiv 2510.22319) and the ``flow-grpo`` per-prompt advantages.

Registered through the ``rlpost`` entry-point group (``flowgrpo = "rlpost_flowgrpo"``). See
``docs/algorithms/flowgrpo.md``.
"""

from __future__ import annotations

from rlpost import AdvantageEstimator, PolicyOptimizer, Registry, Sampler, hookimpl


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register :class:`~rlpost_flowgrpo.sampler.FlowGRPOSampler` (``flow-grpo``)."""
    from .sampler import FlowGRPOSampler

    register(FlowGRPOSampler)


@hookimpl
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register :class:`~rlpost_flowgrpo.advantage.FlowGRPOAdvantage` (``flow-grpo``)."""
    from .advantage import FlowGRPOAdvantage

    register(FlowGRPOAdvantage)


@hookimpl
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register :class:`~rlpost_flowgrpo.update.FlowGRPOUpdate` (``flow-grpo``)."""
    from .update import FlowGRPOUpdate

    register(FlowGRPOUpdate)
