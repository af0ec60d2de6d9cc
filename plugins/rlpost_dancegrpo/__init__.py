"""DanceGRPO for rlpost: SDE chains with DanceGRPO's step, group z-score advantages (the core ``group-zscore``).

Registered through the ``rlpost`` entry-point group (``dancegrpo = "rlpost_dancegrpo"``). See
``docs/algorithms/dancegrpo.md``.
"""

from __future__ import annotations

from rlpost import Registry, Sampler, hookimpl


@hookimpl
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register :class:`~rlpost_dancegrpo.sampler.DanceGRPOSampler` (``dance``)."""
    from .sampler import DanceGRPOSampler

    register(DanceGRPOSampler)
