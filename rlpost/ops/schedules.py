"""Noise-level schedules of rectified-flow models, matching diffusers' ``FlowMatchEulerDiscreteScheduler``.

``sd3_sigmas(T, shift)`` returns exactly (bit for bit, fp32) the ``scheduler.sigmas`` that
``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(T)`` produces (static shift, no dynamic shifting,
no Karras/exponential/beta conversion), including the final 0 the scheduler appends.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["sd3_sigmas", "time_shift", "timesteps_from_sigmas"]

NUM_TRAIN_TIMESTEPS = 1000


def time_shift(sigmas: Tensor, shift: float) -> Tensor:
    """SD3's static time shift ``σ' = s·σ / (1 + (s-1)·σ)`` (Esser et al. 2024, eq. 23; algorithms.md §1.1).

    Args:
        sigmas: Noise levels in ``[0, 1]`` (any shape, any float dtype; computed in that dtype).
        shift: ``s > 0``; 1 is the identity, larger values spend more steps at high noise.

    Returns:
        Shifted noise levels, same shape and dtype.
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sd3_sigmas(num_steps: int, shift: float = 3.0, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Tensor:
    """``[num_steps + 1]`` fp32 noise levels from 1 to 0, as diffusers' flow-match Euler scheduler builds them.

    diffusers (``scheduling_flow_match_euler_discrete.py``) spaces the *unshifted* timesteps linearly between
    ``σ_max = 1`` and ``σ_min`` — the already-shifted smallest training sigma ``shift(1/1000)`` — then shifts them, and
    appends 0. The quirk of shifting ``σ_min`` twice is reproduced so schedules match bit for bit.

    Args:
        num_steps: Number of denoising steps (NFE without guidance), ``>= 1``.
        shift: Static time shift from the scheduler config (SD3/SD3.5: 3.0).
        num_train_timesteps: Training timesteps of the scheduler config (1000 for SD3).

    Returns:
        ``[num_steps + 1]`` fp32, strictly decreasing, ``[0] == 1`` and ``[-1] == 0``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    # Training sigmas at construction: fp32, t/1000 then shifted in fp32 torch (scheduler __init__).
    t_min = torch.tensor(1.0, dtype=torch.float32) / num_train_timesteps
    sigma_min = time_shift(t_min, shift).item()
    sigma_max = time_shift(torch.tensor(1.0, dtype=torch.float32), shift).item()
    # set_timesteps: float64 linspace in timestep units, back to sigmas, shift in float64, then cast to fp32.
    ts = np.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps)
    sig = ts / num_train_timesteps
    sig = shift * sig / (1 + (shift - 1) * sig)
    out = torch.from_numpy(sig).to(torch.float32)
    return torch.cat([out, torch.zeros(1, dtype=torch.float32)])


def timesteps_from_sigmas(sigmas: Tensor, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Tensor:
    """The transformer's ``timestep`` input for noise levels ``σ``: ``1000·σ`` (diffusers SD3/FLUX convention).

    Args:
        sigmas: Noise levels (fp32).
        num_train_timesteps: Scheduler's training timesteps (1000).

    Returns:
        ``sigmas * num_train_timesteps`` in fp32.
    """
    return sigmas.to(torch.float32) * num_train_timesteps
