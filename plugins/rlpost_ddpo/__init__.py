"""DDPO for rlpost: independent flow-SDE chains trained on every step, per-prompt running reward normalisation.

Registered through the ``rlpost`` entry-point group (``ddpo = "rlpost_ddpo"``). See ``docs/algorithms/ddpo.md``.
"""

from __future__ import annotations

from typing import Any

from rlpost.core.hookspecs import hookimpl


@hookimpl
def rlpost_register_samplers(register: Any) -> None:
    """Register :class:`~rlpost_ddpo.sampler.DDPOSampler` (``ddpo``)."""
    from .sampler import DDPOSampler

    register(DDPOSampler)


@hookimpl
def rlpost_register_advantage_estimators(register: Any) -> None:
    """Register :class:`~rlpost_ddpo.advantage.PerPromptStatTracker` (``per-prompt``)."""
    from .advantage import PerPromptStatTracker

    register(PerPromptStatTracker)
