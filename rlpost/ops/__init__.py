"""Pure tensor operations shared by samplers: step kernels (with log-probs) and noise-level schedules."""

from __future__ import annotations

from rlpost.ops.dpm_solver import DPMSolverPP2, dpm_solver_pp2_step
from rlpost.ops.kernels import (
    KERNELS,
    CPSKernel,
    DanceGRPOSDE,
    EulerODE,
    FlowGRPOSDE,
    LogProbReduction,
    StepKernel,
    StepOutput,
    gaussian_log_prob,
    make_kernel,
)
from rlpost.ops.schedules import sd3_sigmas, time_shift, timesteps_from_sigmas

__all__ = [
    "KERNELS",
    "CPSKernel",
    "DPMSolverPP2",
    "DanceGRPOSDE",
    "EulerODE",
    "FlowGRPOSDE",
    "LogProbReduction",
    "StepKernel",
    "StepOutput",
    "dpm_solver_pp2_step",
    "gaussian_log_prob",
    "make_kernel",
    "sd3_sigmas",
    "time_shift",
    "timesteps_from_sigmas",
]
