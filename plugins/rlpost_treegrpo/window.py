"""Window-start laws for TreeGRPO's SDE window (algorithms.md §2.2).

The SDE window ``W_i = {i, …, i+d-1}`` must fit before the final step, so the start ranges over
``i ∈ {0, …, T-d-1}`` (``T-d`` values). Three laws are offered:

* ``geometric`` (the paper's default): the truncated geometric law
  ``P(i) = (1-r)·r^i / (1 - r^(T-d))``. Small ``r`` favours early (high-noise) windows; ``r → 1`` tends to uniform.
  For ``T=10, d=3, r=0.5``: ``P ≈ 0.504, 0.252, 0.126, 0.063, 0.031, 0.016, 0.008``.
* ``uniform``: ``P(i) = 1/(T-d)`` (Flow-GRPO-Fast's window law, algorithms.md §5.4).
* ``fixed``: ``P(fixed_start) = 1`` (the deterministic-window ablation; also what the count tests use).

Only this module knows the laws; the sampler draws from :func:`window_probs` with the run's generator.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["WindowLaw", "draw_window_start", "expected_value", "num_starts", "window_probs"]

WindowLaw = Literal["geometric", "uniform", "fixed"]


def num_starts(num_steps: int, depth: int) -> int:
    """Number of admissible window starts ``T - d`` (starts ``0 … T-d-1``; the window never holds the last step)."""
    return num_steps - depth


def window_probs(
    num_steps: int,
    depth: int,
    law: WindowLaw = "geometric",
    ratio: float = 0.5,
    fixed_start: int | None = None,
) -> Tensor:
    """Probability of each window start ``i = 0 … T-d-1`` as a float64 ``[T-d]`` tensor.

    Args:
        num_steps: Schedule length ``T`` (NFE).
        depth: Window length ``d`` (= tree depth).
        law: ``"geometric"``, ``"uniform"`` or ``"fixed"``.
        ratio: ``r`` of the geometric law, in ``(0, 1)``.
        fixed_start: The start used by the ``fixed`` law.

    Raises:
        ValueError: When the window does not fit or a parameter is out of range.
    """
    n = num_starts(num_steps, depth)
    if n < 1:
        raise ValueError(f"window of depth {depth} does not fit in {num_steps} steps (need depth <= num_steps - 1)")
    if law == "geometric":
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"geometric window ratio must be in (0, 1), got {ratio}")
        i = torch.arange(n, dtype=torch.float64)
        # TreeGRPO §2.2: P(i) = (1-r) r^i / (1 - r^(T-d)); the denominator renormalises the truncated tail.
        return (1.0 - ratio) * ratio**i / (1.0 - ratio**n)
    if law == "uniform":
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    if law == "fixed":
        if fixed_start is None or not 0 <= fixed_start < n:
            raise ValueError(
                f"fixed window start must be in [0, {n - 1}] for T={num_steps}, d={depth}, got {fixed_start}"
            )
        p = torch.zeros(n, dtype=torch.float64)
        p[fixed_start] = 1.0
        return p
    raise ValueError(f"unknown window law {law!r}; choose 'geometric', 'uniform' or 'fixed'")


def draw_window_start(probs: Tensor, generator: torch.Generator) -> int:
    """Draw one window start from ``probs`` with ``generator`` (inverse CDF of one ``torch.rand`` draw).

    One uniform draw per rollout keeps the generator's stream position independent of the law.
    """
    u = float(torch.rand((), generator=generator, device=generator.device, dtype=torch.float64))
    cdf = torch.cumsum(probs.double().cpu(), 0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    return min(idx, int(probs.shape[0]) - 1)


def expected_value(probs: Tensor, values: Tensor) -> float:
    """``E_i[values[i]]`` under the window law (e.g. the expected rollout forwards)."""
    return float((probs.double() * values.double()).sum())
