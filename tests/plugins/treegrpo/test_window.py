"""Window-start laws: the formula, empirical frequencies (chi-square) and validation."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from rlpost_treegrpo.sampler import TreeSampler
from rlpost_treegrpo.window import draw_window_start, window_probs


def test_geometric_formula_matches_paper_table() -> None:
    # algorithms.md §2.2: T=10, d=3, r=0.5 -> 0.5^(i+1) / (1 - 0.5^7) for i = 0..6.
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
    ],
)
def test_sampler_validation_names_the_field(kwargs: dict, field: str) -> None:
    problems = TreeSampler(**kwargs).validate(None)
    assert any(f"sampler.init_args.{field}" in p for p in problems), problems


def test_valid_sampler_has_no_problems() -> None:
    assert TreeSampler().validate(None) == []
    assert TreeSampler(num_steps=4, depth=3, window="fixed", fixed_start=0).validate(None) == []
    with pytest.raises(ValueError, match="does not fit"):
        window_probs(4, 4)
