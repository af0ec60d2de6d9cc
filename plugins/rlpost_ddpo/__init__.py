"""DDPO for rlpost: independent flow-SDE chains trained on every step, per-prompt running reward normalisation.

Registered through the ``rlpost`` entry-point group (``ddpo = "rlpost_ddpo"``). See ``docs/algorithms/ddpo.md``.
"""

from __future__ import annotations

from rlpost import AdvantageEstimator, Registry, Sampler, hookimpl


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register :class:`~rlpost_ddpo.sampler.DDPOSampler` (``ddpo``)."""
    from .sampler import DDPOSampler

    register(DDPOSampler)


@hookimpl
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register :class:`~rlpost_ddpo.advantage.PerPromptStatTracker` (``per-prompt``)."""
    from .advantage import PerPromptStatTracker

    register(PerPromptStatTracker)
