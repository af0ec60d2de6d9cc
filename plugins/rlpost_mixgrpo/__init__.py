"""MixGRPO for rlpost: ODE chains with a sliding SDE window (optionally MixGRPO-Flash's DPM-Solver++ tail), group
z-score advantages (the core ``group-zscore``).

Registered through the ``rlpost`` entry-point group (``mixgrpo = "rlpost_mixgrpo"``). See
``docs/algorithms/mixgrpo.md``.
"""

from __future__ import annotations

from rlpost import Registry, Sampler, hookimpl


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register :class:`~rlpost_mixgrpo.sampler.MixGRPOSampler` (``mix``)."""
    from .sampler import MixGRPOSampler

    register(MixGRPOSampler)
