"""What the bench records about each (algorithm, seed) run, and its JSON summary.

Per iteration (:class:`IterRecord`): wall time, the runner's step phases (:attr:`rlpost.engine.runner.Runner.phases`),
transformer rows counted through :attr:`rlpost.core.api.Policy.forward_count` around the rollout and the update, the
closed-form prediction of the same counts, and peak CUDA memory. Per run: the speed-ups (``run.speedups``) and what
the ratio guard measured before training (:mod:`rlpost.engine.ratio_guard`).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import resource
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlpost.bench.costmodel import Calibration, predict_seconds, predicted_counts
from rlpost.bench.spec import AlgoSpec, BenchSpec
from rlpost.engine.loss_guard import LossCheck
from rlpost.engine.phases import STEP_PHASES, PhaseTimer
from rlpost.engine.ratio_guard import RatioCheck
from rlpost.engine.recipe import Recipe

if TYPE_CHECKING:
    from rlpost.engine.runner import Runner

__all__ = [
    "PHASES",
    "AlgoState",
    "IterRecord",
    "bench_result",
    "machine_info",
    "mean",
    "median_iqr",
    "run_key",
    "run_result",
]

PHASES = STEP_PHASES
"""The per-iteration phases the bench reports (the runner's step phases, :mod:`rlpost.engine.phases`)."""


@dataclass
class IterRecord:
    """One training iteration of one algorithm."""

    iteration: int
    wall_s: float
    cumulative_s: float
    phases: dict[str, float]
    rollout_forwards: int
    train_forwards: int
    reference_forwards: int
    """No-grad reference-policy forwards of the update (a KL term's), counted apart from ``train_forwards``."""
    predicted: dict[str, float]
    images: int
    trainable_edges: int
    reward: float
    peak_mem_gb: float | None


@dataclass
class AlgoState:
    """One (algorithm, seed) runner and everything measured about it.

    Attributes:
        phases: The runner's phase timer (``runner.phases``), read after each step.
    """

    spec: AlgoSpec
    recipe: Recipe
    runner: Runner
    phases: PhaseTimer
    seed: int = 0
    iters: list[IterRecord] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    cumulative_s: float = 0.0
    setup_s: float = 0.0

    @property
    def key(self) -> str:
        """``<algorithm>/seed<s>``: the run's key in ``bench.json`` and its directory below the bench output."""
        return run_key(self.spec.name, self.seed)

    @property
    def tag(self) -> str:
        """Label and seed, for progress lines."""
        return f"{self.spec.label} s{self.seed}"


def run_key(name: str, seed: int) -> str:
    """The key (and relative directory) of one algorithm's run with one training seed."""
    return f"{name}/seed{seed}"


def peak_rss_gb() -> float:
    """This process's peak resident memory (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def median_iqr(values: Sequence[float]) -> tuple[float, float, float]:
    """Median and the 25th/75th percentiles (inclusive method; a single value gives a zero-width range)."""
    if not values:
        return math.nan, math.nan, math.nan
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q[0], q[2]


def mean(values: Sequence[float | None]) -> float:
    """Mean of the values that are present (NaN when none is)."""
    xs = [float(v) for v in values if v is not None]
    return float(statistics.mean(xs)) if xs else math.nan


def run_result(state: AlgoState, calib: Calibration) -> dict[str, Any]:
    """One (algorithm, seed) run: per-iteration records, evaluations and their summaries."""
    iters = state.iters
    walls = [r.wall_s for r in iters]
    med, q1, q3 = median_iqr(walls)
    phases = {p: statistics.mean(r.phases[p] for r in iters) if iters else math.nan for p in PHASES}
    mean_wall = statistics.mean(walls) if walls else math.nan
    overhead = mean_wall - sum(phases.values())  # hooks, gathering, EMA, logging: no phase of the runner's
    counted_roll = [r.rollout_forwards for r in iters]
    counted_train = [r.train_forwards for r in iters]
    pred_roll = [r.predicted["rollout_forwards"] for r in iters]
    pred_train = [r.predicted["train_forwards"] for r in iters]
    counted_ref = [r.reference_forwards for r in iters]
    pred_ref = [r.predicted["reference_forwards"] for r in iters]
    peaks = [r.peak_mem_gb for r in iters if r.peak_mem_gb is not None]
    check = state.runner.ratio_check  # the ratio or the loss guard's measurement (rlpost.engine.ratio_guard)
    return {
        "algorithm": state.spec.name,
        "seed": state.seed,
        "label": state.spec.label,
        "preset": state.spec.preset,
        "run_dir": str(state.recipe.run.output_dir),
        "train_rewards": [r.name for r in state.recipe.rewards],
        "iterations": state.runner.ctx.step,
        "train_time_s": state.cumulative_s,
        "setup_s": state.setup_s,
        "s_per_iter": {
            "median": med,
            "q1": q1,
            "q3": q3,
            "mean": mean_wall,
            "min": min(walls or [math.nan]),
            "max": max(walls or [math.nan]),
        },
        "images_per_iter": statistics.mean(r.images for r in iters) if iters else math.nan,
        "trainable_edges_per_iter": statistics.mean(r.trainable_edges for r in iters) if iters else math.nan,
        "rollout_forwards": {
            "counted_mean": mean(counted_roll),
            "predicted_mean": mean(pred_roll),
            "predicted_expected": predicted_counts(state.recipe)["rollout_forwards_expected"],
            "all_equal": counted_roll == [int(v) for v in pred_roll],
        },
        "train_forwards": {
            "counted_mean": mean(counted_train),
            "predicted_mean": mean(pred_train),
            "all_equal": counted_train == [int(v) for v in pred_train],
        },
        "reference_forwards": {
            "counted_mean": mean(counted_ref),
            "predicted_mean": mean(pred_ref),
            "all_equal": counted_ref == [int(v) for v in pred_ref],
        },
        "phases_mean_s": phases,
        "overhead_s": overhead,
        "overhead_fraction": overhead / mean_wall if mean_wall else math.nan,
        "predicted_s_per_iter": predict_seconds(state.recipe, calib),
        "peak_mem_gb": max(peaks) if peaks else None,
        "speedups": state.recipe.run.speedups.labels(),
        "ratio_guard": check.as_dict() if isinstance(check, RatioCheck) else None,
        "loss_guard": check.as_dict() if isinstance(check, LossCheck) else None,
        "evals": state.evals,
        "iters": [vars(r) for r in iters],
    }


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError, AttributeError):
        info["loadavg_at_end"] = os.getloadavg()
    return info


def bench_result(spec: BenchSpec, algos: list[AlgoState], calib: Calibration, wall_s: float) -> dict[str, Any]:
    """Everything measured and predicted, per run (aggregates are added by the caller), as a JSON-ready dict."""
    return {
        "machine": machine_info(),
        "spec": {
            "output_dir": spec.output_dir,
            "base": spec.base,
            "seeds": spec.seeds,
            "schedule": spec.schedule,
            "time_budget_s": spec.time_budget_s,
            "max_iterations": spec.max_iterations,
            "eval_every": spec.eval_every,
            "fast": spec.fast_names,
            "reference": spec.reference,
            "metric": spec.metric,
            "bootstrap": {
                "resamples": spec.bootstrap_resamples,
                "confidence": spec.confidence,
                "seed": spec.bootstrap_seed,
            },
            "algorithms": [vars(a) for a in spec.algorithms],
            "paper": spec.paper,
            "levels": spec.levels,
            "claims": spec.claims,
        },
        "calibration": vars(calib),
        "peak_rss_gb_process": peak_rss_gb(),
        "bench_wall_s": wall_s,
        "runs": {state.key: run_result(state, calib) for state in algos},
    }
