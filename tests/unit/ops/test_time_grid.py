"""The named time grids: values, the clean tail of each, and the model knob that selects one for a whole run."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlpost.models.sd3 import SD3Policy
from rlpost.ops.schedules import (
    TIME_GRIDS,
    clean_tail_steps,
    sd3_sigmas,
    shifted_linspace_sigmas,
    time_grid_sigmas,
    time_shift,
)
from tests.argument_checks import problems_of
from tests.tolerances import assert_fp32_close


@pytest.mark.parametrize("num_steps", [1, 2, 10, 16, 25])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_shifted_linspace_is_the_shifted_uniform_grid(num_steps: int, shift: float) -> None:
    s = shifted_linspace_sigmas(num_steps, shift)
    assert s.dtype == torch.float32 and s.shape == (num_steps + 1,)
    assert s[0] == 1.0 and s[-1] == 0.0 and bool((s[1:] < s[:-1]).all())
    # Unshifting gives back evenly spaced times k/T (DanceGRPO's linspace(1, 0, T+1)).
    t = s.double() / (shift - (shift - 1) * s.double())
    expected = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    assert torch.allclose(t, expected, atol=1e-6)
    if shift == 1.0:
        assert_fp32_close(s, torch.linspace(1, 0, num_steps + 1))


def test_last_nonzero_levels_of_the_two_grids() -> None:
    # The two grids' ends for SD3.5 (shift 3) at 10 steps: diffusers ends in sigma_min ~0.009, DanceGRPO's grid in 0.25.
    assert float(shifted_linspace_sigmas(10, 3.0)[-2]) == pytest.approx(0.25, abs=1e-6)
    sigma_min = float(time_shift(time_shift(torch.tensor(1e-3, dtype=torch.float64), 3.0), 3.0))
    assert float(sd3_sigmas(10, 3.0)[-2]) == pytest.approx(sigma_min, rel=1e-5)
    assert 0.005 < sigma_min < 0.01


@pytest.mark.parametrize("num_steps", [2, 10, 40])
def test_clean_tail_is_the_steps_landing_below_the_last_noisy_level(num_steps: int) -> None:
    # A level is "clean" when it is diffusers' sigma_min or 0; the steps into clean levels are the clean tail.
    sigma_min = float(sd3_sigmas(num_steps, 3.0)[-2])
    for grid in TIME_GRIDS:
        s = time_grid_sigmas(grid, num_steps, 3.0)
        clean = int((s <= sigma_min * 1.0001).sum())
        assert clean_tail_steps(grid) == clean, grid


def test_grid_by_name_and_unknown_names() -> None:
    assert_fp32_close(time_grid_sigmas("diffusers", 10, 3.0), sd3_sigmas(10, 3.0))
    assert_fp32_close(time_grid_sigmas("shifted-linspace", 10, 3.0), shifted_linspace_sigmas(10, 3.0))
    for fn in (lambda: time_grid_sigmas("karras", 10, 3.0), lambda: clean_tail_steps("karras")):
        with pytest.raises(ValueError, match="diffusers"):
            fn()
    with pytest.raises(ValueError, match="shift"):
        shifted_linspace_sigmas(10, 0.0)


def test_policy_sigmas_follow_the_time_grid_and_shift(make_sd3_policy: Callable[..., SD3Policy]) -> None:
    default = make_sd3_policy()
    assert default.time_grid == "diffusers"
    assert_fp32_close(default.sigmas(10), sd3_sigmas(10, 3.0))  # bit for bit: tests/unit/models/test_sd3.py
    linspace = make_sd3_policy(time_grid="shifted-linspace")
    assert_fp32_close(linspace.sigmas(10), shifted_linspace_sigmas(10, 3.0))  # shift 3 from the scheduler config
    shifted = make_sd3_policy(time_grid="shifted-linspace", shift=1.0)
    assert_fp32_close(shifted.sigmas(4), torch.linspace(1, 0, 5))


def test_policy_validation_names_the_fields() -> None:
    (grid,) = SD3Policy("tiny-random", resolution=32, time_grid="karras").validate(None)  # type: ignore[arg-type]
    assert grid.startswith("model.init_args.time_grid") and "'shifted-linspace'" in grid
    assert problems_of(SD3Policy, "model", pretrained="tiny-random", shift=0.0) == [
        "model.init_args.shift: must be > 0, got 0.0"
    ]
    assert SD3Policy("tiny-random", resolution=32, time_grid="shifted-linspace", shift=3.0).validate(None) == []
