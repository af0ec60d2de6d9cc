"""MixGRPO for rlpost: ODE chains with a sliding SDE window (optionally MixGRPO-Flash's DPM-Solver++ tail), group
z-score advantages (the core ``group-zscore``).

Registered through the ``rlpost`` entry-point group (``mixgrpo = "rlpost_mixgrpo"``). See
``docs/algorithms/mixgrpo.md``.
"""

from __future__ import annotations

from typing import Any

from rlpost.core.hookspecs import hookimpl


@hookimpl
def rlpost_register_samplers(register: Any) -> None:
    """Register :class:`~rlpost_mixgrpo.sampler.MixGRPOSampler` (``mix``)."""
    from .sampler import MixGRPOSampler

    register(MixGRPOSampler)
