"""Multistep DPM-Solver++ (2M, data prediction) for a rectified flow: the deterministic solver of cheap ODE tails
(MixGRPO-Flash's compressed tail, TreeGRPO's ``tail: dpm-solver++``).

It follows the conventions of the step kernels (:mod:`rlpost.ops.kernels`: ``x_σ = (1-σ)·x0 + σ·ε``, ``[B]`` noise
levels, fp32 arithmetic) but is no :class:`~rlpost.ops.kernels.StepKernel`: it has no log-prob and a multistep
history. The formulas are restated from the sources cited below; no upstream code is copied.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from rlpost.ops.kernels import as_f32, per_row

__all__ = ["DPMSolverPP2", "dpm_solver_pp2_step"]


def _lambda(sigma: Tensor) -> Tensor:
    """Half log-SNR of the rectified flow: ``λ = log α - log σ`` with ``α = 1-σ`` (Lu et al. 2022, arXiv 2211.01095)."""
    return torch.log(1.0 - sigma) - torch.log(sigma)


def dpm_solver_pp2_step(
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    sigma_prev: Tensor | None = None,
    prev_x0: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One multistep DPM-Solver++ step (order 2, "midpoint"), data prediction, for a rectified flow.

    Lu et al. 2022 (DPM-Solver++, Alg. 2) in the flow parameterisation used by MixGRPO-Flash
    (``Tencent-Hunyuan/MixGRPO`` ``fastvideo/utils/sampling_utils.py``@e5cdd6a, ``dpm_step``; diffusers
    ``DPMSolverMultistepScheduler`` with ``prediction_type="flow_prediction"``). With ``α = 1-σ``,
    ``λ = log α - log σ``, ``h = λ' - λ`` and ``x̂0 = x - σ·v``::

        x' = (σ'/σ)·x - α'·(e^{-h} - 1)·x̂0                              (order 1 = DDIM)
           - ½·α'·(e^{-h} - 1)·D1,   D1 = (x̂0 - x̂0_prev)/r0,  r0 = h_prev/h   (order 2 correction)

    The second-order term is used when ``sigma_prev`` and ``prev_x0`` are given and ``σ' > 0``; rows stepping to
    ``σ' = 0`` use order 1, whose limit is ``x' = x̂0`` (diffusers' ``final_sigmas_type="zero"`` final step).

    Args:
        x: ``[B, ...]`` states at ``sigma``.
        v: ``[B, ...]`` velocities.
        sigma: ``[B]`` current noise levels.
        sigma_next: ``[B]`` next noise levels.
        sigma_prev: ``[B]`` noise levels of the previous step (where ``prev_x0`` was predicted), or ``None``.
        prev_x0: ``[B, ...]`` the previous step's ``x̂0``, or ``None`` (first step: order 1).

    Returns:
        ``(x_next, x0)``: the next state and this step's ``x̂0`` (pass it as ``prev_x0`` to the next step).
    """
    x, v = as_f32(x), as_f32(v)
    s = per_row(sigma, x.ndim)
    sn = per_row(sigma_next, x.ndim)
    x0 = x - s * v
    final = sn <= 0.0
    # Guard log(0) at the final step; those rows are overwritten with x̂0 below.
    sn_safe = torch.where(final, torch.ones_like(sn) * 0.5, sn)
    h = _lambda(sn_safe) - _lambda(s)
    alpha_n = 1.0 - sn_safe
    phi = torch.expm1(-h)  # e^{-h} - 1, accurate for small h
    nxt = (sn_safe / s) * x - alpha_n * phi * x0
    if sigma_prev is not None and prev_x0 is not None:
        sp = per_row(sigma_prev, x.ndim)
        r0 = (_lambda(s) - _lambda(sp)) / h
        d1 = (x0 - as_f32(prev_x0)) / r0
        nxt = nxt - 0.5 * alpha_n * phi * d1
    nxt = torch.where(final, x0, nxt)
    return nxt, x0


class DPMSolverPP2:
    """Stateful multistep DPM-Solver++ (2M) over a sequence of steps, for MixGRPO-Flash's compressed ODE tail.

    Deterministic (no log-prob). Keeps the previous step's ``σ`` and ``x̂0``; the first step after :meth:`reset` is
    order 1, as is any step to ``σ' = 0`` (lower order at the final step). See :func:`dpm_solver_pp2_step` for the
    formulas. Explicit ``sigma_prev``/``prev_x0`` arguments override the stored state (e.g. for tree nodes whose
    histories differ).
    """

    name: ClassVar[str] = "dpm-solver++2"
    stochastic: ClassVar[bool] = False

    def __init__(self) -> None:
        self._sigma_prev: Tensor | None = None
        self._prev_x0: Tensor | None = None

    def reset(self) -> None:
        """Forget the previous step (start a new trajectory)."""
        self._sigma_prev = None
        self._prev_x0 = None

    def step(
        self,
        x: Tensor,
        v: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        sigma_prev: Tensor | None = None,
        prev_x0: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Advance one step and remember ``(σ, x̂0)`` for the next call.

        Args:
            x: ``[B, ...]`` states.
            v: ``[B, ...]`` velocities.
            sigma: ``[B]`` current noise levels.
            sigma_next: ``[B]`` next noise levels.
            sigma_prev: Previous step's noise levels; defaults to the stored state.
            prev_x0: Previous step's ``x̂0``; defaults to the stored state.

        Returns:
            ``(x_next, x0)``.
        """
        if sigma_prev is None and prev_x0 is None:
            sigma_prev, prev_x0 = self._sigma_prev, self._prev_x0
        nxt, x0 = dpm_solver_pp2_step(x, v, sigma, sigma_next, sigma_prev, prev_x0)
        self._sigma_prev, self._prev_x0 = as_f32(sigma).reshape(-1), x0
        return nxt, x0
