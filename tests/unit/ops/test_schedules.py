"""Schedules match diffusers' FlowMatchEulerDiscreteScheduler bit for bit."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rlpost.ops.schedules import sd3_sigmas, time_shift, timesteps_from_sigmas


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 2.5])
@pytest.mark.parametrize("num_steps", [1, 2, 10, 28, 40])
def test_sd3_sigmas_match_diffusers(num_steps: int, shift: float) -> None:
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(num_steps)
    ours = sd3_sigmas(num_steps, shift)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert torch.equal(ours, sched.sigmas)
    assert torch.equal(timesteps_from_sigmas(ours[:-1]), sched.timesteps)


def test_sd3_sigmas_endpoints_and_monotone() -> None:
    s = sd3_sigmas(10, 3.0)
    assert s[0] == 1.0 and s[-1] == 0.0
    assert bool((s[1:] < s[:-1]).all())


def test_time_shift_properties() -> None:
    x = torch.linspace(0, 1, 11, dtype=torch.float64)
    assert torch.allclose(time_shift(x, 1.0), x)
    shifted = time_shift(x, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1
    assert bool((shifted[1:-1] > x[1:-1]).all())  # shift > 1 moves steps toward high noise


def test_sd3_sigmas_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        sd3_sigmas(0, 3.0)
