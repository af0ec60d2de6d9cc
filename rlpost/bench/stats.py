"""Statistics over training seeds for ``rlpost bench``: means, percentile bootstrap intervals, ratios, and the one
rule that decides whether two results may be called different.

Every quantity the bench compares (seconds per iteration, held-out reward at equal iterations or equal wall time,
time to reach a reward level) has one value per training seed. :func:`summarize` gives the mean, a percentile
bootstrap interval of the mean (resampling seeds with replacement, a fixed RNG seed so reports are reproducible) and,
because three seeds make any interval rough, the min and max as well. :func:`ratio_summary` does the same for a
ratio of two algorithms' means, resampling each algorithm's seeds independently.

:func:`verdict` is the only place that turns two intervals into words: ``"separated"`` when they do not overlap,
``"not separated"`` otherwise. The report states a direction ("faster", "higher") only for separated results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_RESAMPLES",
    "compare",
    "first_reach",
    "ratio_summary",
    "separated",
    "summarize",
    "verdict",
]

DEFAULT_RESAMPLES = 10_000
DEFAULT_CONFIDENCE = 0.95


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _percentiles(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100.0 * (1.0 - confidence) / 2.0
    lo, hi = np.percentile(samples, [tail, 100.0 - tail])
    return float(lo), float(hi)


def summarize(
    values: Sequence[float | None],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> dict[str, Any]:
    """Mean, percentile-bootstrap interval of the mean, min and max of per-seed values.

    ``None`` and non-finite values are dropped (an evaluation that did not happen is not a zero); ``n`` says how
    many remained. One value gives a zero-width interval, none gives NaNs.

    Args:
        values: One value per training seed.
        resamples: Bootstrap resamples.
        confidence: Central mass of the interval (0.95: 2.5th to 97.5th percentile).
        seed: RNG seed of the resampling (reports are reproducible from the JSON).

    Returns:
        ``{"n", "mean", "lo", "hi", "min", "max", "values"}``.
    """
    xs = _finite(values)
    if not xs:
        nan = math.nan
        return {"n": 0, "mean": nan, "lo": nan, "hi": nan, "min": nan, "max": nan, "values": []}
    arr = np.asarray(xs, dtype=np.float64)
    mean = float(arr.mean())
    if len(xs) == 1:
        lo = hi = mean
    else:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, len(xs), size=(resamples, len(xs)))
        lo, hi = _percentiles(arr[idx].mean(axis=1), confidence)
    return {
        "n": len(xs),
        "mean": mean,
        "lo": lo,
        "hi": hi,
        "min": float(arr.min()),
        "max": float(arr.max()),
        "values": xs,
    }


def ratio_summary(
    numerator: Sequence[float | None],
    denominator: Sequence[float | None],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> dict[str, Any]:
    """``mean(numerator) / mean(denominator)`` with a percentile bootstrap interval.

    The two algorithms' seeds are independent runs, so each side is resampled on its own. ``min``/``max`` are the
    extreme ratios of one seed's value over another's.

    Returns:
        ``{"n_num", "n_den", "mean", "lo", "hi", "min", "max"}``; NaNs when a side has no values or the denominators
        are not all of one sign (a zero time, e.g. a level met before training, makes a ratio meaningless).
    """
    num, den = np.asarray(_finite(numerator)), np.asarray(_finite(denominator))
    nan = math.nan
    out: dict[str, Any] = {
        "n_num": int(num.size),
        "n_den": int(den.size),
        "mean": nan,
        "lo": nan,
        "hi": nan,
        "min": nan,
        "max": nan,
    }
    if num.size == 0 or den.size == 0 or not (bool(np.all(den > 0)) or bool(np.all(den < 0))):
        return out
    out["mean"] = float(num.mean() / den.mean())
    pairs = num[:, None] / den[None, :]
    out["min"], out["max"] = float(pairs.min()), float(pairs.max())
    if num.size == 1 and den.size == 1:
        out["lo"] = out["hi"] = out["mean"]
        return out
    rng = np.random.default_rng(seed)
    n_means = num[rng.integers(0, num.size, size=(resamples, num.size))].mean(axis=1)
    d_means = den[rng.integers(0, den.size, size=(resamples, den.size))].mean(axis=1)
    out["lo"], out["hi"] = _percentiles(n_means / d_means, confidence)
    return out


def separated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two closed intervals ``(lo, hi)`` are disjoint (touching counts as overlapping; NaN never separates).

    A point is the interval ``(x, x)``.
    """
    values = [*a, *b]
    if any(not math.isfinite(v) for v in values):
        return False
    return a[1] < b[0] or b[1] < a[0]


def verdict(a: dict[str, Any] | tuple[float, float], b: dict[str, Any] | tuple[float, float]) -> str:
    """``"separated"`` or ``"not separated"`` for two summaries (``lo``/``hi`` keys) or ``(lo, hi)`` pairs."""

    def interval(x: dict[str, Any] | tuple[float, float]) -> tuple[float, float]:
        if isinstance(x, dict):
            return float(x.get("lo", math.nan)), float(x.get("hi", math.nan))
        return float(x[0]), float(x[1])

    return "separated" if separated(interval(a), interval(b)) else "not separated"


def compare(
    label_a: str,
    a: dict[str, Any],
    label_b: str,
    b: dict[str, Any],
    *,
    quantity: str,
    higher: str = "higher",
    lower: str = "lower",
) -> str:
    """One sentence comparing two summaries; a direction only when the intervals separate.

    Example: ``"s/iter: TreeGRPO lower than DanceGRPO (separated)"`` or ``"s/iter: TreeGRPO vs DanceGRPO not
    separated"``. ``higher``/``lower`` name the direction in the quantity's own words ("slower"/"faster").
    """
    if verdict(a, b) != "separated":
        return f"{quantity}: {label_a} vs {label_b} not separated"
    word = higher if a["mean"] > b["mean"] else lower
    return f"{quantity}: {label_a} {word} than {label_b} (separated)"


def first_reach(evals: Sequence[dict[str, Any]], key: str, level: float) -> dict[str, Any] | None:
    """The first evaluation record whose ``key`` is at least ``level`` (``None``: not reached).

    Records are in training order and carry ``iteration`` and ``train_time_s``; the resolution is the bench's
    evaluation interval.
    """
    for record in evals:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and value >= level:
            return record
    return None
