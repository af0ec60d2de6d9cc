"""The chain samplers' last-two-steps settings are checked in one place (``rlpost.last_steps_problems``)."""

from __future__ import annotations

import pytest

from rlpost import last_steps_problems
from rlpost_dancegrpo.sampler import DanceGRPOSampler
from rlpost_ddpo.sampler import DDPOSampler


def test_last_steps_problems_names_each_bad_field_in_order() -> None:
    assert last_steps_problems("ode", "sde") == []
    assert last_steps_problems("sde", "ode") == []
    assert last_steps_problems("euler", "both") == [
        "sampler.init_args.final_step: must be 'ode' or 'sde', got 'both'",
        "sampler.init_args.penultimate_step: must be 'ode' or 'sde', got 'euler'",
    ]


@pytest.mark.parametrize("sampler_cls", [DanceGRPOSampler, DDPOSampler])
def test_chain_samplers_report_bad_last_steps(sampler_cls: type) -> None:
    problems = sampler_cls(final_step="both", penultimate_step="euler").validate(None)
    assert "sampler.init_args.final_step: must be 'ode' or 'sde', got 'both'" in problems
    assert "sampler.init_args.penultimate_step: must be 'ode' or 'sde', got 'euler'" in problems
    assert sampler_cls().validate(None) == []
