"""Tree tails: how the leaves of a tree go from the branching window's end to ``σ = 0`` (TreeGRPO's, beyond its paper;
BranchGRPO and TempFlow-GRPO complete their children the same way).

The leaves only need a good final image for the reward; their tail edges are never trained and carry no log-prob
(``docs/algorithms/treegrpo.md``, "Cheap tails"). Three solvers (``tail``):

* ``full`` (the paper's and the official code's): one Euler ODE step per remaining step of the run's grid;
* ``euler``: Euler steps on a shortened tail grid;
* ``dpm-solver++``: multistep DPM-Solver++ (2M, data prediction; order 1 at the tail's first and final step) on the
  tail grid, as MixGRPO-Flash runs after its window (``Tencent-Hunyuan/MixGRPO``
  ``fastvideo/utils/sampling_utils.py``@e5cdd6a, ``dpm_step``).

A shortened tail makes ``min(tail_steps, T-i-d)`` transformer evaluations per leaf (:func:`tail_nfe`) on one of two
grids (``tail_grid``, :func:`tail_sigmas`): ``run`` (evenly spread points of the run's own remaining grid, end points
kept) or ``compressed`` (MixGRPO-Flash's fresh time-shifted grid from the window's end to 0, shift ``tail_shift``).
The tail only appends noise levels after the window, so trunk and window steps keep their schedule indices.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from rlpost.ops.dpm_solver import dpm_solver_pp2_step
from rlpost.ops.kernels import LogProbReduction, StepKernel
from rlpost.ops.schedules import shifted_tail_sigmas, subsampled_indices

__all__ = ["DPM_TAIL_KERNEL", "TailGrid", "TailSolver", "TailStepper", "tail_nfe", "tail_problems", "tail_sigmas"]

TailSolver = Literal["full", "euler", "dpm-solver++"]
"""How the leaves are brought from the window's end to the image (see ``TreeSampler``, ``tail``)."""

TailGrid = Literal["run", "compressed"]
"""Which noise levels a shortened tail visits (see ``TreeSampler``, ``tail_grid``)."""

DPM_TAIL_KERNEL = "dpm-solver++2"
"""Kernel name recorded for the deterministic DPM-Solver++ (2M) tail edges (never evaluated; NaN log-prob)."""


def tail_nfe(remaining: int, tail_steps: int | None) -> int:
    """Transformer evaluations per leaf when ``remaining`` steps follow the window: ``min(tail_steps, remaining)``
    (``tail_steps`` ``None``: every remaining step)."""
    return remaining if tail_steps is None else min(tail_steps, remaining)


def tail_sigmas(sigmas: Tensor, steps: int, end: int, n: int, grid: TailGrid, shift: float) -> Tensor:
    """The rollout's noise levels: the run's ``steps``-step grid ``sigmas`` (CPU fp32) up to the window's end
    ``end``, then an ``n``-step tail on ``grid``.

    A tail of every remaining step on the ``run`` grid returns ``sigmas`` itself, so the paper preset is unchanged
    bit for bit.
    """
    if grid == "compressed":
        tail = shifted_tail_sigmas(float(sigmas[end]), n, shift)
    elif n == steps - end:
        return sigmas
    else:
        tail = sigmas[subsampled_indices(end, steps, n)]
    return torch.cat([sigmas[: end + 1], tail[1:]])


def tail_problems(prefix: str, tail: str, tail_steps: int | None, tail_grid: str) -> list[str]:
    """Problems with the tail settings together, each naming its field under ``prefix`` (``sampler.init_args``); the
    ranges of ``tail_steps`` and ``tail_shift`` are the sampler's declared argument ranges."""
    p = prefix
    problems: list[str] = []
    if tail not in ("full", "euler", "dpm-solver++"):
        problems.append(f"{p}.tail: must be 'full', 'euler' or 'dpm-solver++', got {tail!r}")
    if tail_grid not in ("run", "compressed"):
        problems.append(f"{p}.tail_grid: must be 'run' or 'compressed', got {tail_grid!r}")
    if tail == "full":
        if tail_steps is not None or tail_grid != "run":
            problems.append(
                f"{p}.tail: 'full' runs every remaining step of the run's grid; tail_steps/tail_grid need tail "
                f"'euler' or 'dpm-solver++' (got tail_steps={tail_steps}, tail_grid={tail_grid!r})"
            )
    if tail_grid == "compressed" and tail_steps is None:
        problems.append(f"{p}.tail_steps: tail_grid 'compressed' needs a number of tail steps, got null")
    return problems


class TailStepper:
    """The steps of one rollout's tail, in order; carries DPM-Solver++'s history (the previous tail step's σ, x̂0).

    Args:
        solver: The tail solver (``full`` and ``euler`` both step with ``ode``).
        ode: The deterministic Euler kernel (kernel index 1).
        reduction: Log-prob reduction passed to ``ode`` (its log-prob is NaN either way).
    """

    def __init__(self, solver: TailSolver, ode: StepKernel, reduction: LogProbReduction) -> None:
        self.solver: TailSolver = solver
        self.ode = ode
        self.reduction: LogProbReduction = reduction
        self._prev_sigma: Tensor | None = None
        self._prev_x0: Tensor | None = None

    def step(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor, int]:
        """One tail step of the frontier ``x`` with velocity ``v``: (next latents, NaN log-probs, kernel index)."""
        if self.solver == "dpm-solver++":
            # Order 1 at the tail's first step: the leaf's own trajectory has no earlier x̂0 (its parent's was
            # predicted before the SDE noise was added); order 2 from then on, order 1 into σ = 0.
            x_next, x0 = dpm_solver_pp2_step(x, v, sigma, sigma_next, self._prev_sigma, self._prev_x0)
            self._prev_sigma, self._prev_x0 = sigma, x0
            return x_next, torch.full((x.shape[0],), math.nan, dtype=torch.float64), 2
        out = self.ode.step(x, v, sigma, sigma_next, None, self.reduction)
        return out.next_latents, out.log_prob, 1
