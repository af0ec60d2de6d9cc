"""Window-start laws for a tree sampler's SDE window (TreeGRPO: Ding & Ye, arXiv 2512.08153;
docs/algorithms/treegrpo.md).

The SDE window ``W_i = {i, …, i+d-1}`` must fit before the final step, so the start ranges over
``i ∈ {0, …, T-d-1}`` (``T-d`` values). Four laws are offered:

* ``geometric`` (the paper's default): the truncated geometric law
  ``P(i) = (1-r)·r^i / (1 - r^(T-d))``. Small ``r`` favours early (high-noise) windows; ``r → 1`` tends to uniform.
  For ``T=10, d=3, r=0.5``: ``P ≈ 0.504, 0.252, 0.126, 0.063, 0.031, 0.016, 0.008``.
* ``uniform``: ``P(i) = 1/(T-d)`` (Flow-GRPO-Fast's law, ``yifan123/flow_grpo`` ``scripts/train_sd3_fast.py@74db691``).
* ``fixed``: ``P(fixed_start) = 1`` (the deterministic-window ablation; also what the count tests use).
* ``progressive`` (the official TreeGRPO code's schedule, ``zh-ding/TreeGRPO`` ``train.py`` and
  ``configs/base.yaml``: the window starts at step 0 and shifts by one step every 50 iterations, MixGRPO-like): not
  random, the start is a function of the training step, :func:`progressive_start`.

The random laws are drawn once per training step (``TreeSampler.begin_step``) with the step's generator; only this
module knows the laws.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
from torch import Tensor

__all__ = [
    "WindowLaw",
    "WindowSettings",
    "draw_window_start",
    "expected_value",
    "PROGRESSIVE_DEFAULTS",
    "num_starts",
    "progressive_setting",
    "progressive_start",
    "progressive_starts",
    "window_law_probs",
    "window_law_problems",
    "window_law_repr",
    "window_law_start",
    "window_probs",
]

WindowLaw = Literal["geometric", "uniform", "fixed", "progressive"]

PROGRESSIVE_DEFAULTS: dict[str, Any] = {"shift_interval": 50, "stride": 1, "roll_back": True}
"""Upstream's ``progressive`` settings (:func:`progressive_start`), used where a recipe leaves one ``null``."""


def progressive_setting(name: str, value: Any) -> Any:
    """A ``progressive`` setting ``name`` (``shift_interval``, ``stride``, ``roll_back``), or upstream's default when
    ``value`` is ``None``."""
    return PROGRESSIVE_DEFAULTS[name] if value is None else value


def num_starts(num_steps: int, depth: int) -> int:
    """Number of admissible window starts ``T - d`` (starts ``0 … T-d-1``; the window never holds the last step)."""
    return num_steps - depth


def progressive_starts(num_steps: int, depth: int, stride: int = 1, roll_back: bool = True) -> list[int]:
    """The window starts one pass of the ``progressive`` schedule visits, in order (each for ``shift_interval`` steps).

    The start moves by ``stride`` from 0; a move past the last admissible start ``T-d-1`` rolls back to 0
    (``roll_back``, the pass then repeats) or stops at ``T-d-1`` (which the run then keeps).

    Raises:
        ValueError: When the window does not fit or ``stride < 1``.
    """
    last = num_starts(num_steps, depth) - 1
    if last < 0:
        raise ValueError(f"window of depth {depth} does not fit in {num_steps} steps (need depth <= num_steps - 1)")
    if stride < 1:
        raise ValueError(f"progressive window stride must be >= 1, got {stride}")
    starts = list(range(0, last + 1, stride))
    if not roll_back and starts[-1] != last:
        starts.append(last)
    return starts


def progressive_start(
    step: int, num_steps: int, depth: int, shift_interval: int, stride: int = 1, roll_back: bool = True
) -> int:
    """Window start of training step ``step`` (0-based) under the ``progressive`` schedule.

    The official TreeGRPO code's schedule, restated (``zh-ding/TreeGRPO`` ``train.py``, ``configs/base.yaml``:
    ``tou = 50`` iterations between shifts of one step): ``m = step // shift_interval`` moves have happened, the start
    is ``m · stride``, and a start past ``T-d-1`` rolls back to 0 (``roll_back``) or stays at ``T-d-1``. It is a
    function of the step alone, so a resumed run continues the sequence without saved state.

    Upstream's code could not be read at a pinned commit when this was written: the bounds (the window's last step
    before ``T-1``, as for every law here) and the behaviour past the last start are ours. Upstream's defaults
    (``T=10``, ``w=4``, 50 iterations per shift, 300 iterations) visit the starts ``0 … 5`` once and never reach the
    end, so ``roll_back`` does not change that run.

    Raises:
        ValueError: When ``step < 0``, ``shift_interval < 1``, ``stride < 1`` or the window does not fit.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if shift_interval < 1:
        raise ValueError(f"progressive window shift_interval must be >= 1, got {shift_interval}")
    starts = progressive_starts(num_steps, depth, stride, roll_back)
    moves = step // shift_interval
    return starts[moves % len(starts)] if roll_back else starts[min(moves, len(starts) - 1)]


def window_probs(
    num_steps: int,
    depth: int,
    law: WindowLaw = "geometric",
    ratio: float = 0.5,
    fixed_start: int | None = None,
    stride: int = 1,
    roll_back: bool = True,
) -> Tensor:
    """Probability of each window start ``i = 0 … T-d-1`` as a float64 ``[T-d]`` tensor.

    For the deterministic ``progressive`` schedule this is the share of steps spent at each start over one pass of
    :func:`progressive_starts` (with ``roll_back`` also the long-run share; without it, a run longer than one pass
    stays at the last start).

    Args:
        num_steps: Schedule length ``T`` (NFE).
        depth: Window length ``d`` (= tree depth).
        law: ``"geometric"``, ``"uniform"``, ``"fixed"`` or ``"progressive"``.
        ratio: ``r`` of the geometric law, in ``(0, 1)``.
        fixed_start: The start used by the ``fixed`` law.
        stride: Steps the ``progressive`` window moves by.
        roll_back: ``progressive``: restart at 0 after the last start.

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
    if law == "progressive":
        starts = progressive_starts(num_steps, depth, stride, roll_back)
        p = torch.zeros(n, dtype=torch.float64)
        p[starts] = 1.0 / len(starts)
        return p
    raise ValueError(f"unknown window law {law!r}; choose 'geometric', 'uniform', 'fixed' or 'progressive'")


def draw_window_start(probs: Tensor, generator: torch.Generator) -> int:
    """Draw one window start from ``probs`` with ``generator`` (inverse CDF of one ``torch.rand`` draw).

    One uniform draw keeps the generator's stream position independent of the law.
    """
    u = float(torch.rand((), generator=generator, device=generator.device, dtype=torch.float64))
    cdf = torch.cumsum(probs.double().cpu(), 0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    return min(idx, int(probs.shape[0]) - 1)


def expected_value(probs: Tensor, values: Tensor) -> float:
    """``E_i[values[i]]`` under the window law (e.g. the expected rollout forwards)."""
    return float((probs.double() * values.double()).sum())


class WindowSettings(Protocol):
    """The window-law settings of a tree sampler (``TreeSampler``'s init args of the same names)."""

    num_steps: int
    depth: int
    window: WindowLaw
    ratio: float
    fixed_start: int | None
    shift_interval: int | None
    stride: int | None
    roll_back: bool | None


def window_law_probs(s: WindowSettings) -> Tensor:
    """:func:`window_probs` of the settings ``s`` (``null`` progressive settings take upstream's defaults)."""
    stride, roll_back = progressive_setting("stride", s.stride), progressive_setting("roll_back", s.roll_back)
    return window_probs(s.num_steps, s.depth, s.window, s.ratio, s.fixed_start, int(stride), bool(roll_back))


def window_law_start(s: WindowSettings, step: int, generator: torch.Generator) -> int:
    """Training step ``step``'s window start: one draw from the law with ``generator`` (one uniform), or the step's
    position on the ``progressive`` schedule (no draw)."""
    if s.window == "progressive":
        interval = int(progressive_setting("shift_interval", s.shift_interval))
        stride, roll_back = progressive_setting("stride", s.stride), progressive_setting("roll_back", s.roll_back)
        return progressive_start(step, s.num_steps, s.depth, interval, int(stride), bool(roll_back))
    return draw_window_start(window_law_probs(s), generator)


def window_law_repr(s: WindowSettings) -> str:
    """The law's part of the sampler's ``repr``."""
    if s.window != "progressive":
        return f"window={s.window!r}, r={s.ratio}"
    every, stride = progressive_setting("shift_interval", s.shift_interval), progressive_setting("stride", s.stride)
    roll_back = progressive_setting("roll_back", s.roll_back)
    return f"window='progressive', every={every}, stride={stride}, roll_back={roll_back}"


def window_law_problems(prefix: str, s: WindowSettings) -> list[str]:
    """Problems with the window-law settings together, each naming its field under ``prefix``
    (``sampler.init_args``); the ranges of ``ratio``, ``shift_interval`` and ``stride`` are the sampler's declared
    argument ranges."""
    p, num_steps, depth, window, fixed_start = prefix, s.num_steps, s.depth, s.window, s.fixed_start
    shift_interval, stride, roll_back = s.shift_interval, s.stride, s.roll_back
    problems: list[str] = []
    if window == "fixed":
        hi = num_starts(num_steps, depth) - 1
        if fixed_start is None or not 0 <= fixed_start <= hi:
            problems.append(f"{p}.fixed_start: window 'fixed' needs a start in [0, {hi}], got {fixed_start}")
    elif fixed_start is not None:
        problems.append(f"{p}.fixed_start: only used with window 'fixed' (window is {window!r})")
    if window != "progressive":
        for name, value in (("shift_interval", shift_interval), ("stride", stride), ("roll_back", roll_back)):
            if value is not None:
                problems.append(f"{p}.{name}: only used with window 'progressive' (window is {window!r})")
    if window not in ("geometric", "uniform", "fixed", "progressive"):
        problems.append(f"{p}.window: must be 'geometric', 'uniform', 'fixed' or 'progressive', got {window!r}")
    return problems
