"""Noise-level schedules (time grids) of rectified-flow models.

Two grids are in use by the algorithms rlpost ports, and a recipe picks one by name (:data:`TIME_GRIDS`,
``model.init_args.time_grid``), so every sampler and the held-out evaluation of a run share it:

* ``"diffusers"`` — :func:`sd3_sigmas`: exactly (bit for bit, fp32) the ``scheduler.sigmas`` that
  ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(T)`` produces (static shift, no dynamic shifting,
  no Karras/exponential/beta conversion), including the final 0 the scheduler appends. Its last nonzero level is
  ``σ_min`` (about 0.009 for SD3.5's shift 3, 0.001 for shift 1), so the step before it jumps from about 0.28 to
  almost clean. Used by ``StableDiffusion3Pipeline``, Flow-GRPO (``yifan123/flow_grpo``
  ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py``@ac4c86e: ``retrieve_timesteps`` on the pipeline's
  scheduler) and the official TreeGRPO code, which samples through that pipeline.
* ``"shifted-linspace"`` — :func:`shifted_linspace_sigmas`: ``time_shift(linspace(1, 0, T+1), shift)``, the grid
  of DanceGRPO (``XueZeyue/DanceGRPO`` ``fastvideo/train_grpo_flux.py``@15cc71d, ``sd3_time_shift`` applied to
  ``torch.linspace(1, 0, sampling_steps + 1)``) and MixGRPO (``Tencent-Hunyuan/MixGRPO``
  ``fastvideo/train_grpo_flux.py``@e5cdd6a, the same construction). Its last nonzero level is ``shift(1/T)``
  (0.25 for shift 3 and ``T = 10``).

:func:`clean_tail_steps` says how many final steps of a grid land on a (near-)clean level; samplers that must not
leave sampled noise in the decoded image keep those steps deterministic (see ``docs/models.md``, "Time grids").
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "TIME_GRIDS",
    "TimeGrid",
    "clean_tail_steps",
    "sd3_sigmas",
    "shifted_tail_sigmas",
    "subsampled_indices",
    "shifted_linspace_sigmas",
    "time_grid_sigmas",
    "time_shift",
    "timesteps_from_sigmas",
]

NUM_TRAIN_TIMESTEPS = 1000

TimeGrid = Literal["diffusers", "shifted-linspace"]
"""Name of a time grid (see the module docstring)."""

TIME_GRIDS: tuple[str, ...] = get_args(TimeGrid)
"""Every valid :data:`TimeGrid` name."""


def time_shift(sigmas: Tensor, shift: float) -> Tensor:
    """SD3's static time shift ``σ' = s·σ / (1 + (s-1)·σ)`` (Esser et al. 2024, arXiv 2403.03206, eq. 23).

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


def shifted_linspace_sigmas(num_steps: int, shift: float = 3.0) -> Tensor:
    """``[num_steps + 1]`` fp32 noise levels ``time_shift(linspace(1, 0, T+1), shift)``: DanceGRPO's and MixGRPO's grid.

    Restates ``XueZeyue/DanceGRPO`` ``fastvideo/train_grpo_flux.py``@15cc71d (``sd3_time_shift(args.shift,
    torch.linspace(1, 0, args.sampling_steps + 1))``, fp32 throughout); MixGRPO builds the same grid
    (``Tencent-Hunyuan/MixGRPO`` ``fastvideo/train_grpo_flux.py``@e5cdd6a). Unlike the diffusers grid, every one of
    the ``T`` steps moves by a comparable amount of unshifted time ``1/T``, and the last nonzero level is
    ``shift(1/T)`` instead of diffusers' ``σ_min``.

    Args:
        num_steps: Number of denoising steps, ``>= 1``.
        shift: Static time shift ``s > 0`` (the scheduler config's ``shift``; DanceGRPO/MixGRPO pass ``--shift 3``).

    Returns:
        ``[num_steps + 1]`` fp32, strictly decreasing, ``[0] == 1`` and ``[-1] == 0``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return time_shift(torch.linspace(1, 0, num_steps + 1, dtype=torch.float32), float(shift))


def time_grid_sigmas(grid: str, num_steps: int, shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Tensor:
    """``[num_steps + 1]`` fp32 noise levels of the named time grid (the one place a grid name becomes sigmas).

    Args:
        grid: ``"diffusers"`` (:func:`sd3_sigmas`) or ``"shifted-linspace"`` (:func:`shifted_linspace_sigmas`).
        num_steps: Number of denoising steps, ``>= 1``.
        shift: Static time shift.
        num_train_timesteps: Training timesteps of the scheduler config (only the diffusers grid uses it).

    Raises:
        ValueError: For an unknown grid name.
    """
    if grid == "diffusers":
        return sd3_sigmas(num_steps, shift, num_train_timesteps)
    if grid == "shifted-linspace":
        return shifted_linspace_sigmas(num_steps, shift)
    raise ValueError(f"unknown time grid {grid!r}; choose one of {list(TIME_GRIDS)}")


def subsampled_indices(first: int, last: int, num_steps: int) -> Tensor:
    """``num_steps + 1`` strictly increasing grid indices from ``first`` to ``last`` (both kept), evenly spread.

    ``floor(linspace(first, last, n+1) + 1/2)``: consecutive points are at least one index apart when
    ``num_steps <= last - first``, so no step is empty; ``num_steps = last - first`` gives every index. Used to run an
    ODE tail on a coarser subset of a run's own grid (TreeGRPO's ``tail_grid: run``, see
    ``docs/algorithms/treegrpo.md``, "Beyond the paper").

    Raises:
        ValueError: When ``num_steps`` is not in ``[1, last - first]``.
    """
    if not 1 <= num_steps <= last - first:
        raise ValueError(
            f"num_steps must be in [1, {last - first}] to subsample indices {first}..{last}, got {num_steps}"
        )
    pts = torch.linspace(float(first), float(last), num_steps + 1, dtype=torch.float64)
    return torch.floor(pts + 0.5).long()


def shifted_tail_sigmas(sigma_end: float, num_steps: int, shift: float) -> Tensor:
    """A fresh time-shifted grid of ``num_steps`` steps from ``sigma_end`` down to 0 (MixGRPO-Flash's post-window
    schedule).

    Restates ``Tencent-Hunyuan/MixGRPO`` ``fastvideo/utils/sampling_utils.py``@e5cdd6a (``run_sample_step``,
    ``dpm_apply_strategy == "post"``): the unshifted time ``t`` of ``sigma_end`` (the inverse of
    :func:`time_shift`, ``t = σ / (s - (s-1)·σ)``) is spaced linearly down to 0 and shifted again, so the coarse tail
    keeps the model's time-shift profile. Computed in float64, returned in fp32 with the end points set exactly.

    Args:
        sigma_end: Noise level the tail starts from, in ``(0, 1]``.
        num_steps: Steps of the tail, ``>= 1``.
        shift: Static time shift ``s > 0``.

    Returns:
        ``[num_steps + 1]`` fp32, ``[0] == sigma_end``, ``[-1] == 0``, strictly decreasing.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if not 0.0 < sigma_end <= 1.0:
        raise ValueError(f"sigma_end must be in (0, 1], got {sigma_end}")
    t_end = sigma_end / (shift - (shift - 1.0) * sigma_end)
    out = time_shift(torch.linspace(t_end, 0.0, num_steps + 1, dtype=torch.float64), shift).to(torch.float32)
    out[0] = sigma_end
    out[-1] = 0.0
    return out


def clean_tail_steps(grid: str) -> int:
    """How many final steps of ``grid`` land on a (near-)clean level, for any ``T >= 2``.

    ``"shifted-linspace"``: 1 (only the step to 0). ``"diffusers"``: 2 — the step into ``σ_min`` (about 0.009 for
    shift 3) and the appended step to 0. Sampled noise of a step into such a level stays in the decoded image: the
    remaining steps remove at most ``σ_min·v``. DanceGRPO and DDPO keep these steps deterministic by default.

    Raises:
        ValueError: For an unknown grid name.
    """
    if grid == "diffusers":
        return 2
    if grid == "shifted-linspace":
        return 1
    raise ValueError(f"unknown time grid {grid!r}; choose one of {list(TIME_GRIDS)}")
