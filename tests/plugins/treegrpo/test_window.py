"""Window-start laws: the formula, empirical frequencies (chi-square), the progressive schedule and validation."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from rlpost.core.contract import PromptBatch
from rlpost.ops.trees.window import draw_window_start, progressive_start, progressive_starts, window_probs
from rlpost_treegrpo.sampler import TreeSampler
from tests.argument_checks import problems_of


def test_geometric_formula_matches_paper_table() -> None:
    # arXiv 2512.08153, Sec. "Method" (truncated geometric window start).
    # T=10, d=3, r=0.5 -> 0.5^(i+1) / (1 - 0.5^7) for i = 0..6.
    p = window_probs(10, 3, "geometric", 0.5)
    expected = torch.tensor([0.5 ** (i + 1) / (1 - 0.5**7) for i in range(7)], dtype=torch.float64)
    torch.testing.assert_close(p, expected)
    assert p.sum().item() == pytest.approx(1.0)
    assert [round(v, 3) for v in p.tolist()] == [0.504, 0.252, 0.126, 0.063, 0.031, 0.016, 0.008]


def _draw(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([draw_window_start(probs, gen) for _ in range(n)])


@pytest.mark.parametrize(
    ("law", "ratio"), [("geometric", 0.5), ("geometric", 0.3), ("geometric", 0.7), ("uniform", 0.5)]
)
def test_empirical_frequencies_chi_square(law: str, ratio: float) -> None:
    probs = window_probs(10, 3, law, ratio)  # type: ignore[arg-type]
    n = 20_000
    observed = torch.bincount(_draw(probs, n, seed=1234), minlength=probs.numel()).double()
    expected = probs * n
    # Pool sparse tail cells so every expected count is >= 5 (chi-square validity).
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum().reshape(1)]) if (~keep).any() else observed
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)]) if (~keep).any() else expected
    assert observed.sum() == n
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


def test_fixed_window_is_deterministic() -> None:
    probs = window_probs(6, 2, "fixed", fixed_start=3)
    assert set(_draw(probs, 200, seed=0).tolist()) == {3}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_steps": 4, "depth": 4}, "depth"),
        ({"k": 1}, "k"),
        ({"ratio": 1.0}, "ratio"),
        ({"ratio": 0.0}, "ratio"),
        ({"window": "fixed", "fixed_start": 7, "depth": 3}, "fixed_start"),
        ({"window": "fixed"}, "fixed_start"),
        ({"fixed_start": 1}, "fixed_start"),
        ({"kernel_args": {"bogus": 1}}, "kernel_args"),
        ({"trees_per_prompt": 0}, "trees_per_prompt"),
        ({"window": "progressive", "shift_interval": 0}, "shift_interval"),
        ({"window": "progressive", "stride": 0}, "stride"),
        ({"shift_interval": 50}, "shift_interval"),
        ({"window": "uniform", "roll_back": False}, "roll_back"),
    ],
)
def test_sampler_validation_names_the_field(kwargs: dict, field: str) -> None:
    problems = problems_of(TreeSampler, "sampler", **kwargs)
    assert any(f"sampler.init_args.{field}" in p for p in problems), problems


def test_valid_sampler_has_no_problems() -> None:
    assert TreeSampler().validate(None) == []
    assert TreeSampler(num_steps=4, depth=3, window="fixed", fixed_start=0).validate(None) == []
    with pytest.raises(ValueError, match="does not fit"):
        window_probs(4, 4)


def test_progressive_schedule_upstream_defaults() -> None:
    """Official-code defaults (T=10, w=4, one-step shift every 50 iterations): starts 0 … 5, each for 50 steps."""
    starts = [progressive_start(t, 10, 4, shift_interval=50) for t in range(300)]
    assert starts == [i for i in range(6) for _ in range(50)]
    assert max(starts) + 4 - 1 < 10 - 1  # the window's last step stays before the final step
    assert progressive_start(300, 10, 4, 50) == 0  # roll back after the last start
    assert progressive_start(300, 10, 4, 50, roll_back=False) == 5  # or stay there
    assert progressive_start(10_000, 10, 4, 50, roll_back=False) == 5


def test_progressive_schedule_stride_and_bounds() -> None:
    # T=10, d=3: starts 0 … 6; stride 2 visits 0, 2, 4, 6 then rolls back, or stops at 6.
    assert [progressive_start(t, 10, 3, shift_interval=1, stride=2) for t in range(6)] == [0, 2, 4, 6, 0, 2]
    # T=10, d=4: last start 5 is not on the stride-2 grid: 0, 2, 4, then 5 when holding (MixGRPO's clip).
    assert progressive_starts(10, 4, stride=2, roll_back=False) == [0, 2, 4, 5]
    assert progressive_starts(10, 4, stride=2, roll_back=True) == [0, 2, 4]
    assert [progressive_start(t, 10, 4, 2, stride=2, roll_back=False) for t in range(0, 12, 2)] == [0, 2, 4, 5, 5, 5]
    with pytest.raises(ValueError, match="shift_interval"):
        progressive_start(0, 10, 4, shift_interval=0)
    with pytest.raises(ValueError, match="stride"):
        progressive_starts(10, 4, stride=0)
    # Share of steps per start over one pass (the expectation used for expected rollout forwards).
    torch.testing.assert_close(
        window_probs(10, 3, "progressive", stride=2), torch.tensor([0.25, 0, 0.25, 0, 0.25, 0, 0.25]).double()
    )


def test_progressive_sampler_sets_the_start_per_step_without_drawing() -> None:
    sampler = TreeSampler(num_steps=10, k=2, depth=4, window="progressive", shift_interval=2)
    assert sampler.validate(None) == []
    gen = torch.Generator().manual_seed(0)
    before = gen.get_state()
    seen = []
    for step in range(14):
        sampler.begin_step(step, gen)
        seen.append(sampler.window_start)
    assert seen == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0]
    assert torch.equal(gen.get_state(), before), "the progressive schedule draws nothing"
    # Worst case = start 0; expectation over one pass of starts 0 … 5.
    assert sampler.counts(1, 1).rollout_forwards == sampler.rollout_forwards_at(0, 1)
    mean = sum(sampler.rollout_forwards_at(i, 1) for i in range(6)) / 6
    assert sampler.expected_rollout_forwards(1) == pytest.approx(mean)


def test_random_law_draws_once_per_step_and_rollout_needs_it() -> None:
    sampler = TreeSampler(num_steps=10, k=2, depth=3, window="uniform")
    batch = PromptBatch(["a cat"], [{}], 1)
    with pytest.raises(RuntimeError, match="begin_step"):
        sampler.rollout(None, batch, torch.Generator())  # type: ignore[arg-type]
    starts = []
    for seed in range(40):
        sampler.begin_step(0, torch.Generator().manual_seed(seed))
        starts.append(sampler.window_start)
        again = TreeSampler(num_steps=10, k=2, depth=3, window="uniform")
        again.begin_step(5, torch.Generator().manual_seed(seed))
        assert again.window_start == starts[-1], "the start is a function of the step's generator only"
    assert len(set(starts)) > 3
