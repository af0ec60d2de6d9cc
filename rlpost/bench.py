"""``rlpost bench``: TreeGRPO, DanceGRPO, MixGRPO and DDPO side by side, over several training seeds, in one process,
interleaved step by step.

A bench recipe (``recipes/bench/digits.yaml``) names a shared base recipe, one overlay per algorithm, and the
published numbers to print next to ours::

    bench:
      output_dir: runs/bench-digits      # <algorithm>/seed<s>/ run directories below it, plus the tables and the plot
      base: [recipes/bench/digits/base.yaml]
      seeds: [0, 1, 2]                   # training seeds (run.seed) per algorithm; or num_seeds: 3; absent: the
                                         #   recipe's own run.seed, once
      schedule: least-time               # or round-robin
      time_budget_s: 90                  # per (algorithm, seed) training time (equal wall time); null = no limit
      max_iterations: 400                # per (algorithm, seed) cap (the only stop when time_budget_s is null)
      eval_every: 5                      # held-out evaluation every N iterations (plus 0 and the last); not timed
      reference: dancegrpo               # what the fast algorithms are compared with (ratios, reward levels)
      fast: [treegrpo-paper, treegrpo-code]
      metric: null                       # held-out key for reward levels; null = eval/<first training reward>
      bootstrap: {resamples: 10000, confidence: 0.95, seed: 0}
      calibration: {repeats: 5, batch_sizes: [1, 4, 16, 64]}
    algorithms:
      - {name: treegrpo-paper, label: TreeGRPO, preset: treegrpo-paper, recipes: [recipes/bench/digits/...]}
      - ...
    paper:                               # optional; printed next to ours, never used in a computation of ours
      source: TreeGRPO, arXiv 2512.08153
      s_per_iter: {source: Table 1, values: {treegrpo-paper: 72.0, dancegrpo: 173.5}}
      time_to_reward: {source: Fig. 1 (GPU-hours), values: {...}}
      notes: {treegrpo-code: "..."}

Every (algorithm, seed) gets its own :class:`rlpost.runner.Runner` (own policy, LoRA, optimizer, run directory);
the bench drives ``Runner.step()`` itself. With ``least-time`` it always advances the runner with the least
accumulated training time, so every algorithm and seed runs in the same stretches of wall clock and background load
hits all alike. Held-out evaluations happen between steps and are excluded from the training time.

Measured per iteration: wall time, per-phase time (transformer forward in the rollout and in the update, backward,
optimizer step, VAE decode, reward scoring; the rest is overhead), transformer rows counted through the policy's
``forward_count`` before/after the rollout and the update, and peak memory. Predicted: the same counts from the
sampler's closed forms (``Sampler.counts``; TreeGRPO's rollout at the drawn window start via
``rollout_forwards_at``), and seconds per iteration from a cost model calibrated on this machine (per-row forward
and forward+backward cost at the relevant batch sizes, decode+reward per image).

Across seeds (``rlpost.bench_stats``): mean, percentile bootstrap interval and min–max of s/iter, of every
held-out ``eval/...`` metric at equal iterations and at equal wall time, of the time to reach the reference's reward
level, and of the reference/fast ratios. A difference is stated only where the intervals separate.

Outputs (in ``bench.output_dir``): ``bench.json`` (every run and the aggregates), ``bench.md`` (a table shaped like
the TreeGRPO paper's Table 1, held-out tables, ratios, reward levels, conclusions, cost model and phases),
``reward_vs_wallclock.png``, and each run's directory with its own ``bench_run.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from rlpost import bench_stats as bs
from rlpost.api import Policy, StepCounts
from rlpost.plugins import PluginHost, get_host
from rlpost.recipe import Recipe, RecipeError, RunConfig, merge_sources, validate
from rlpost.rundir import json_safe

__all__ = ["AlgoSpec", "BenchSpec", "Bench", "aggregate", "comparisons", "load_bench", "main"]

PHASES = ("rollout_forward", "train_forward", "backward", "optimizer", "decode", "reward")
PAPER_QUANTITIES = ("s_per_iter", "time_to_reward")
"""Published quantities a bench recipe's ``paper`` section may give per algorithm (printed next to ours)."""


# ------------------------------------------------------------------------------------------------- the spec


@dataclass
class AlgoSpec:
    """One benchmarked algorithm: overlays on the shared base.

    Attributes:
        name: Short name (run directory, JSON keys).
        label: Display name in tables and plots.
        recipes: Overlay recipe files merged after the bench's base.
        overrides: ``{"a.b": value}`` applied last (as ``--a.b value``).
        preset: Which preset produced its numbers (named in every results table); defaults to ``name``.
    """

    name: str
    label: str
    recipes: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    preset: str = ""

    def __post_init__(self) -> None:
        self.preset = self.preset or self.name


@dataclass
class BenchSpec:
    """The ``bench`` section, the algorithms and the ``paper`` section (see the module docstring).

    ``seeds=None`` runs each algorithm once with its recipe's own ``run.seed``. ``fast`` is one name or several.
    ``paper`` is normalised by :func:`load_bench` to ``{"source": str, "notes": {name: str}, QUANTITY: {"source":
    str, "values": {name: float}, "notes": {name: str}}}``.
    """

    output_dir: str
    base: list[str]
    algorithms: list[AlgoSpec]
    schedule: str = "least-time"
    time_budget_s: float | None = None
    max_iterations: int = 10
    eval_every: int = 0
    reference: str | None = None
    fast: str | list[str] | None = None
    calibration_repeats: int = 5
    calibration_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    overrides: dict[str, Any] = field(default_factory=dict)
    seeds: list[int] | None = None
    metric: str | None = None
    bootstrap_resamples: int = bs.DEFAULT_RESAMPLES
    confidence: float = bs.DEFAULT_CONFIDENCE
    bootstrap_seed: int = 0
    paper: dict[str, Any] = field(default_factory=dict)

    @property
    def fast_names(self) -> list[str]:
        """``fast`` as a list."""
        return _as_names(self.fast)


def _as_names(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _parse_paper(raw: Any, names: list[str], problems: list[str]) -> dict[str, Any]:
    """Normalise the ``paper`` section (published numbers) and list every problem with its field."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("paper: expected a mapping {source, s_per_iter, time_to_reward, notes}")
        return {}
    known = {"source", "notes", *PAPER_QUANTITIES}
    problems += [f"paper.{k}: unknown key (known: {', '.join(sorted(known))})" for k in raw if k not in known]
    out: dict[str, Any] = {"source": str(raw.get("source", "")), "notes": {}}
    for name, note in dict(raw.get("notes") or {}).items():
        if name not in names:
            problems.append(f"paper.notes.{name}: not one of the algorithms {names}")
        out["notes"][str(name)] = str(note)
    for qty in PAPER_QUANTITIES:
        section = raw.get(qty)
        if section is None:
            continue
        if not isinstance(section, dict) or not isinstance(section.get("values"), dict):
            problems.append(f"paper.{qty}: expected {{source: ..., values: {{algorithm: number}}}}")
            continue
        parsed: dict[str, Any] = {"source": str(section.get("source", "")), "values": {}, "notes": {}}
        for name, value in section["values"].items():
            where = f"paper.{qty}.values.{name}"
            if name not in names:
                problems.append(f"{where}: not one of the algorithms {names}")
                continue
            note = None
            if isinstance(value, dict):
                note, value = value.get("note"), value.get("value")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                problems.append(f"{where}: expected a positive number (or {{value, note}}), got {value!r}")
                continue
            parsed["values"][str(name)] = float(value)
            if note:
                parsed["notes"][str(name)] = str(note)
        out[qty] = parsed
    return out


def load_bench(path: str, overrides: Sequence[tuple[str, str]] = ()) -> BenchSpec:
    """Read a bench recipe; ``overrides`` are ``("bench.key", "yaml value")`` pairs (``--bench.max_iterations 3``).

    Raises:
        RecipeError: Missing file, unknown keys or a bad value (every problem listed).
    """
    p = Path(path)
    if not p.is_file():
        raise RecipeError([f"bench recipe not found: {path}"])
    data = yaml.safe_load(p.read_text()) or {}
    problems: list[str] = []
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: expected a mapping with bench, algorithms and (optionally) paper"])
    problems += [
        f"{k}: unknown top-level key (known: algorithms, bench, paper)"
        for k in data
        if k not in ("bench", "algorithms", "paper")
    ]
    for dotted, raw in overrides:
        parts = dotted.split(".")
        if parts[0] != "bench" or len(parts) != 2:
            problems.append(f"--{dotted}: bench overrides look like --bench.KEY VALUE")
            continue
        data.setdefault("bench", {})[parts[1]] = yaml.safe_load(raw)
    bench = dict(data.get("bench") or {})
    algos = data.get("algorithms") or []
    known = {
        "output_dir",
        "base",
        "seeds",
        "num_seeds",
        "schedule",
        "time_budget_s",
        "max_iterations",
        "eval_every",
        "reference",
        "fast",
        "metric",
        "bootstrap",
        "calibration",
        "overrides",
    }
    problems += [f"bench.{k}: unknown key (known: {', '.join(sorted(known))})" for k in bench if k not in known]
    if not isinstance(algos, list) or not algos:
        problems.append("algorithms: give a non-empty list of {name, recipes}")
        algos = []
    specs: list[AlgoSpec] = []
    for i, a in enumerate(algos):
        if not isinstance(a, dict) or "name" not in a:
            problems.append(f"algorithms[{i}]: needs a name")
            continue
        extra = set(a) - {"name", "label", "preset", "recipes", "overrides"}
        if extra:
            problems.append(
                f"algorithms[{i}]: unknown keys {sorted(extra)} (known: name, label, preset, recipes, overrides)"
            )
        specs.append(
            AlgoSpec(
                str(a["name"]),
                str(a.get("label", a["name"])),
                list(a.get("recipes", [])),
                dict(a.get("overrides") or {}),
                str(a.get("preset") or ""),
            )
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        problems.append(f"algorithms: names must be unique, got {names}")
    schedule = str(bench.get("schedule", "least-time"))
    if schedule not in ("least-time", "round-robin"):
        problems.append(f"bench.schedule: 'least-time' or 'round-robin', got {schedule!r}")
    seeds = _parse_seeds(bench, problems)
    calib = dict(bench.get("calibration") or {})
    boot = dict(bench.get("bootstrap") or {})
    problems += [
        f"bench.bootstrap.{k}: unknown key (known: confidence, resamples, seed)"
        for k in boot
        if k not in ("resamples", "confidence", "seed")
    ]
    spec = BenchSpec(
        output_dir=str(bench.get("output_dir", "runs/bench")),
        base=list(bench.get("base", [])),
        algorithms=specs,
        schedule=schedule,
        time_budget_s=None if bench.get("time_budget_s") is None else float(bench["time_budget_s"]),
        max_iterations=int(bench.get("max_iterations", 10)),
        eval_every=int(bench.get("eval_every", 0)),
        reference=bench.get("reference"),
        fast=bench.get("fast"),
        calibration_repeats=int(calib.get("repeats", 5)),
        calibration_batch_sizes=[int(b) for b in calib.get("batch_sizes", [1, 4, 16, 64])],
        overrides=dict(bench.get("overrides") or {}),
        seeds=seeds,
        metric=None if bench.get("metric") is None else str(bench["metric"]),
        bootstrap_resamples=int(boot.get("resamples", bs.DEFAULT_RESAMPLES)),
        confidence=float(boot.get("confidence", bs.DEFAULT_CONFIDENCE)),
        bootstrap_seed=int(boot.get("seed", 0)),
        paper=_parse_paper(data.get("paper"), names, problems),
    )
    if spec.max_iterations < 1:
        problems.append(f"bench.max_iterations: must be >= 1, got {spec.max_iterations}")
    if spec.time_budget_s is not None and not spec.time_budget_s > 0:
        problems.append(f"bench.time_budget_s: must be > 0 or null, got {spec.time_budget_s}")
    if spec.bootstrap_resamples < 100:
        problems.append(f"bench.bootstrap.resamples: must be >= 100, got {spec.bootstrap_resamples}")
    if not 0.0 < spec.confidence < 1.0:
        problems.append(f"bench.bootstrap.confidence: must be in (0, 1), got {spec.confidence}")
    if spec.metric is not None and not spec.metric.startswith("eval/"):
        problems.append(f"bench.metric: a held-out metric name starting with 'eval/', got {spec.metric!r}")
    for key, values in (("reference", _as_names(spec.reference)), ("fast", spec.fast_names)):
        problems += [f"bench.{key}: {v!r} is not one of the algorithms {names}" for v in values if v not in names]
    if spec.reference is not None and spec.reference in spec.fast_names:
        problems.append(f"bench.fast: the reference {spec.reference!r} cannot also be a fast algorithm")
    if problems:
        raise RecipeError(problems)
    return spec


def _parse_seeds(bench: dict[str, Any], problems: list[str]) -> list[int] | None:
    """``seeds: [0, 1, 2]`` or ``num_seeds: 3`` (= seeds 0..2); neither: ``None`` (the recipe's run.seed)."""
    if bench.get("seeds") is not None and bench.get("num_seeds") is not None:
        problems.append("bench.seeds / bench.num_seeds: give one of them, not both")
        return None
    if bench.get("num_seeds") is not None:
        n = bench["num_seeds"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"bench.num_seeds: a positive integer, got {n!r}")
            return None
        return list(range(n))
    raw = bench.get("seeds")
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list) or not raw or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in raw):
        problems.append(f"bench.seeds: a non-empty list of non-negative integers, got {raw!r}")
        return None
    if len(set(raw)) != len(raw):
        problems.append(f"bench.seeds: seeds must be distinct, got {raw}")
        return None
    return [int(s) for s in raw]


# --------------------------------------------------------------------------------------------- measurement


class PhaseTimer:
    """Wall time per (phase) category, accumulated by wrapped callables; synchronises CUDA around each call so
    asynchronous kernels are charged to the call that launched them."""

    def __init__(self, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        """Zero every category (at the start of a step)."""
        self.totals = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def timed(self, category: str) -> Iterator[None]:
        """Charge the enclosed block to ``category``."""
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[category] += time.perf_counter() - t0

    def wrap(self, fn: Callable[..., Any], category: str | Callable[[], str]) -> Callable[..., Any]:
        """``fn`` timed into ``category`` (a name, or a function returning one at call time)."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.timed(category() if callable(category) else category):
                return fn(*args, **kwargs)

        return wrapped


class _Probe:
    """Lifecycle plugin: records the policy's forward count at the end of the rollout of the stepping runner."""

    def __init__(self) -> None:
        self.after_rollout: dict[int, int] = {}
        self.window_start: dict[int, int] = {}

    def rlpost_after_rollout(self, run: Any, rollout: Any) -> None:
        policy = run.recipe.model
        self.after_rollout[id(run)] = int(getattr(policy, "forward_count", 0))
        start = rollout.stats.get("tree/window_start")
        if start is not None:
            self.window_start[id(run)] = int(start)


def _probe_plugin(probe: _Probe) -> object:
    """Wrap the probe's method as a pluggy hookimpl (the marker must be applied to a function on an object)."""
    from rlpost.hookspecs import hookimpl

    class ProbePlugin:
        @hookimpl
        def rlpost_after_rollout(self, run: Any, rollout: Any) -> None:
            probe.rlpost_after_rollout(run, rollout)

    return ProbePlugin()


@dataclass
class IterRecord:
    """One training iteration of one algorithm."""

    iteration: int
    wall_s: float
    cumulative_s: float
    phases: dict[str, float]
    rollout_forwards: int
    train_forwards: int
    predicted: dict[str, float]
    images: int
    trainable_edges: int
    reward: float
    peak_mem_gb: float | None


@dataclass
class AlgoState:
    """One (algorithm, seed) runner and everything measured about it."""

    spec: AlgoSpec
    recipe: Recipe
    runner: Any
    timer: PhaseTimer
    seed: int = 0
    iters: list[IterRecord] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    cumulative_s: float = 0.0
    setup_s: float = 0.0
    done: bool = False

    @property
    def policy(self) -> Policy:
        return self.recipe.model

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


def _peak_rss_gb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def _median_iqr(values: Sequence[float]) -> tuple[float, float, float]:
    """Median and the 25th/75th percentiles (inclusive method; a single value gives a zero-width range)."""
    if not values:
        return math.nan, math.nan, math.nan
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q[0], q[2]


# ------------------------------------------------------------------------------------------- cost model


@dataclass
class Calibration:
    """Per-row seconds of a no-grad forward and of a forward+backward at several batch sizes, and decode+reward
    seconds per image, measured on this machine with the bench's own policy."""

    batch_sizes: list[int]
    forward_s_per_row: list[float]
    fwd_bwd_s_per_row: list[float]
    decode_reward_s_per_image: float

    def per_row(self, kind: str, batch: float) -> float:
        """Per-row cost at ``batch`` rows per call, interpolated linearly in log(batch) between measured sizes."""
        ys = self.forward_s_per_row if kind == "forward" else self.fwd_bwd_s_per_row
        xs = [math.log(b) for b in self.batch_sizes]
        x = math.log(max(1.0, batch))
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        for i in range(len(xs) - 1):
            if xs[i] <= x <= xs[i + 1]:
                w = (x - xs[i]) / (xs[i + 1] - xs[i])
                return ys[i] * (1 - w) + ys[i + 1] * w
        return ys[-1]


def calibrate(state: AlgoState, batch_sizes: Sequence[int], repeats: int) -> Calibration:
    """Micro-benchmark the policy's transformer (forward; forward+backward through the trainable weights) at each
    batch size, and decode + every training reward per image. Gradients are cleared afterwards, so the run's
    optimizer state is untouched."""
    policy = state.policy
    device = policy.device
    gen = torch.Generator().manual_seed(12345)
    prompts = [p for p, _ in state.recipe.prompts.load()]
    meta_all = [m for _, m in state.recipe.prompts.load()]
    params = policy.trainable_parameters()
    timer = PhaseTimer(device)
    fwd: list[float] = []
    fb: list[float] = []
    count0 = int(getattr(policy, "forward_count", 0))
    for b in batch_sizes:
        # Prompts of their own: the policy caches embeddings per prompt string, and an embedding computed inside a
        # calibration batch could differ in the last bit (bf16) from the one training and evaluation would compute.
        cond = policy.encode([f"calibration prompt {i}" for i in range(b)])
        x = policy.initial_noise(b, gen)
        sigma = torch.full((b,), 0.5)
        samples_f: list[float] = []
        samples_fb: list[float] = []
        for r in range(repeats + 1):  # the first call of each size warms up allocator and kernels
            timer.reset()
            with timer.timed("rollout_forward"), torch.no_grad():
                policy.velocity(x, sigma, cond)
            policy.train(True)  # as the update rule does (gradient checkpointing, if enabled, is active then)
            with timer.timed("train_forward"):
                loss = policy.velocity(x, sigma, cond).square().mean()
                loss.backward()  # type: ignore[no-untyped-call]
            policy.train(False)
            if r:
                samples_f.append(timer.totals["rollout_forward"] / b)
                samples_fb.append(timer.totals["train_forward"] / b)
        fwd.append(statistics.median(samples_f))
        fb.append(statistics.median(samples_fb))
    for p in params:
        p.grad = None
    # Decode + reward on a batch the size of a typical rollout decode.
    n = max(batch_sizes)
    rows = [prompts[i % len(prompts)] for i in range(n)]
    meta = [dict(meta_all[i % len(meta_all)]) for i in range(n)]
    latents = policy.initial_noise(n, gen).clamp(-1, 1)
    per_image: list[float] = []
    for r in range(repeats + 1):
        timer.reset()
        with timer.timed("decode"):
            images = policy.decode(latents)
        with timer.timed("reward"):
            for reward in state.recipe.rewards:
                reward.score(images, rows, meta)
        if r:
            per_image.append((timer.totals["decode"] + timer.totals["reward"]) / n)
    if hasattr(policy, "forward_count"):
        setattr(policy, "forward_count", count0)  # noqa: B010 - calibration rows are not training rows
    return Calibration(list(batch_sizes), fwd, fb, statistics.median(per_image))


def nominal_batches(recipe: Recipe, counts: StepCounts) -> tuple[float, float]:
    """Rows per transformer call in the rollout and in the update, from the recipe alone.

    Rollout: tails/chains run the full frontier (``images``) at once, capped by the sampler's ``chunk_size``.
    Update: parents per minibatch = ``minibatch_edges`` / (edges per parent), capped by the step's parents.
    """
    chunk = float(getattr(recipe.sampler, "chunk_size", counts.images) or counts.images)
    rollout_b = min(chunk, float(counts.images))
    edges_per_parent = counts.trainable_edges / max(1, counts.train_forwards)
    mb_edges = float(getattr(recipe.optimizer, "minibatch_edges", counts.trainable_edges))
    train_b = min(float(counts.train_forwards), max(1.0, mb_edges / edges_per_parent))
    return rollout_b, train_b


def predicted_counts(recipe: Recipe) -> dict[str, float]:
    """Closed-form counts of an iteration (MixGRPO's depend on the window its ``begin_step`` set, so call after it).

    ``rollout_forwards_expected`` is the mean over TreeGRPO's window law (equal to ``rollout_forwards`` for chains).
    """
    run = recipe.run
    c = recipe.counts()
    epochs = int(getattr(recipe.optimizer, "inner_epochs", 1))
    sampler = recipe.sampler
    expected = (
        float(sampler.expected_rollout_forwards(run.groups_per_step))
        if hasattr(sampler, "expected_rollout_forwards")
        else float(c.rollout_forwards)
    )
    return {
        "images": float(c.images),
        "trainable_edges": float(c.trainable_edges),
        "rollout_forwards": float(c.rollout_forwards),
        "rollout_forwards_expected": expected,
        "train_forwards": float(c.train_forwards * epochs),
    }


def predict_seconds(recipe: Recipe, calib: Calibration) -> dict[str, float]:
    """Seconds per iteration from the closed-form counts and the calibration (no overhead term)."""
    c = recipe.counts()
    pred = predicted_counts(recipe)
    rollout_b, train_b = nominal_batches(recipe, c)
    rollout = pred["rollout_forwards_expected"] * calib.per_row("forward", rollout_b)
    train = pred["train_forwards"] * calib.per_row("fwd_bwd", train_b)
    decode_reward = pred["images"] * calib.decode_reward_s_per_image
    return {
        "rollout_forward_s": rollout,
        "train_fwd_bwd_s": train,
        "decode_reward_s": decode_reward,
        "total_s": rollout + train + decode_reward,
        "rollout_batch": rollout_b,
        "train_batch": train_b,
    }


# ------------------------------------------------------------------------------------------------- the bench


class Bench:
    """Builds one runner per algorithm, calibrates, interleaves their steps, evaluates and reports.

    Args:
        spec: The bench recipe.
        host: Plugin host (the process-wide one by default).
        log: Progress lines (stderr by default).
    """

    def __init__(
        self, spec: BenchSpec, host: PluginHost | None = None, log: Callable[[str], None] | None = None
    ) -> None:
        self.spec = spec
        self.host = host or get_host()
        self.out = Path(spec.output_dir)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.algos: list[AlgoState] = []
        self.calibration: Calibration | None = None
        self.probe = _Probe()
        self.started = 0.0

    # ----------------------------------------------------------------------------------------------- set-up
    def _runs(self) -> list[tuple[AlgoSpec, int | None]]:
        """(algorithm, seed) pairs in set-up order: seed-major, so schedule ties alternate between algorithms."""
        seeds: list[int | None] = list(self.spec.seeds) if self.spec.seeds is not None else [None]
        return [(algo, seed) for seed in seeds for algo in self.spec.algorithms]

    def build(self) -> None:
        """Validate every (algorithm, seed) recipe (all problems at once), then set up the runners.

        A seed of ``None`` (no ``bench.seeds``) keeps the recipe's own ``run.seed``.
        """
        from rlpost.runner import Runner

        taken = [self.out / a.name for a in self.spec.algorithms] + [self.out / "bench.json"]
        if any(p.exists() for p in taken):
            raise FileExistsError(f"bench output directory {self.out} already holds a bench; choose another --out")
        problems: list[str] = []
        planned: list[tuple[AlgoSpec, Recipe]] = []
        for algo, seed in self._runs():
            overrides = {**self.spec.overrides, **algo.overrides}
            pairs = [(k, yaml.safe_dump(v, default_flow_style=True).strip()) for k, v in overrides.items()]
            if seed is not None:
                pairs.append(("run.seed", str(seed)))
            pairs.append(("run.progress", "false"))
            try:
                cfg = merge_sources([*self.spec.base, *algo.recipes], pairs)
                # Evaluation is driven by the bench between steps (untimed); the runner must not evaluate itself.
                if isinstance(cfg.get("eval"), dict):
                    cfg["eval"]["every"] = 0
                # The run directory names the seed the run really uses (the recipe's own when bench.seeds is unset).
                run_cfg = cfg.setdefault("run", {})
                if isinstance(run_cfg, dict):
                    used = run_cfg.get("seed", RunConfig.seed)
                    run_cfg["output_dir"] = str(self.out / run_key(algo.name, used))
                planned.append((algo, validate(cfg, self.host)))
            except RecipeError as exc:
                # Seeds share an algorithm's recipe, so its problems are listed once.
                problems += [m for p in exc.problems if (m := f"{algo.name}: {p}") not in problems]
        if problems:
            raise RecipeError(problems)
        self.out.mkdir(parents=True, exist_ok=True)
        self.host.register_plugin(_probe_plugin(self.probe), name="rlpost.bench.probe")
        for algo, recipe in planned:
            t0 = time.perf_counter()
            runner = Runner(recipe, self.host)
            runner.setup()
            state = AlgoState(algo, recipe, runner, PhaseTimer(runner.device), seed=recipe.run.seed)
            state.setup_s = time.perf_counter() - t0
            self._instrument(state)
            self.host.hook.rlpost_before_run(run=runner.ctx)
            self.algos.append(state)
            self.log(f"[bench] {state.tag}: set up in {state.setup_s:.1f}s ({recipe.derived()})")

    def _instrument(self, state: AlgoState) -> None:
        """Time the transformer, backward, optimizer step, decode and rewards of this runner (instance wrappers)."""
        policy: Any = state.policy
        timer = state.timer

        def forward_kind() -> str:
            # Training forwards are the ones that build a graph; rollout (and evaluation) forwards run no-grad.
            return "train_forward" if torch.is_grad_enabled() else "rollout_forward"

        policy.velocity = timer.wrap(policy.velocity, forward_kind)
        policy.decode = timer.wrap(policy.decode, "decode")
        backend: Any = state.runner.backend
        backend.backward = timer.wrap(backend.backward, "backward")
        backend.step = timer.wrap(backend.step, "optimizer")
        for reward in state.recipe.rewards:
            reward_any: Any = reward
            reward_any.score = timer.wrap(reward.score, "reward")

    # -------------------------------------------------------------------------------------------- evaluation
    def _evaluate(self, state: AlgoState) -> None:
        runner = state.runner
        metrics = runner.evaluate()
        record = {"iteration": runner.ctx.step, "train_time_s": state.cumulative_s, **eval_metrics(metrics)}
        state.evals.append(record)
        shown = " ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("eval/"))
        self.log(f"[bench] {state.tag} it {runner.ctx.step} t={state.cumulative_s:.1f}s held-out {shown}")

    # ---------------------------------------------------------------------------------------------- stepping
    def _step(self, state: AlgoState) -> None:
        runner = state.runner
        policy: Any = state.policy
        state.timer.reset()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        before = int(getattr(policy, "forward_count", 0))
        t0 = time.perf_counter()
        metrics = runner.step()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        pred = predicted_counts(state.recipe)  # after the step: MixGRPO's counts follow the window its begin_step set
        after = int(getattr(policy, "forward_count", 0))
        mid = self.probe.after_rollout.get(id(runner.ctx), before)
        start = self.probe.window_start.get(id(runner.ctx))
        sampler: Any = state.recipe.sampler
        if start is not None and hasattr(sampler, "rollout_forwards_at"):
            pred["rollout_forwards"] = float(sampler.rollout_forwards_at(start, state.recipe.run.groups_per_step))
        state.cumulative_s += wall
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        state.iters.append(
            IterRecord(
                iteration=runner.ctx.step,
                wall_s=wall,
                cumulative_s=state.cumulative_s,
                phases=dict(state.timer.totals),
                rollout_forwards=mid - before,
                train_forwards=after - mid,
                predicted=pred,
                images=int(metrics.get("perf/images", 0)),
                trainable_edges=int(metrics.get("train/edges", 0)),
                reward=float(metrics.get("reward/weighted", math.nan)),
                peak_mem_gb=peak,
            )
        )

    def _finished(self, state: AlgoState) -> bool:
        budget = self.spec.time_budget_s
        return state.runner.ctx.step >= self.spec.max_iterations or (
            budget is not None and state.cumulative_s >= budget
        )

    def _next(self, turn: int) -> AlgoState | None:
        live = [a for a in self.algos if not self._finished(a)]
        if not live:
            return None
        if self.spec.schedule == "round-robin":
            # Rotate the order every round so no algorithm always runs right after another's allocations.
            live.sort(key=lambda a: (a.runner.ctx.step, (self.algos.index(a) - turn) % len(self.algos)))
            return live[0]
        return min(live, key=lambda a: (a.cumulative_s, self.algos.index(a)))

    def run(self) -> dict[str, Any]:
        """Build, calibrate, run the interleaved schedule, evaluate, write the report; returns the JSON result."""
        self.build()
        self.started = time.perf_counter()
        self.calibration = calibrate(self.algos[0], self.spec.calibration_batch_sizes, self.spec.calibration_repeats)
        self.log(f"[bench] calibration: {self.calibration}")
        turn = 0
        status = "failed"
        try:
            for algo in self.algos:
                self._evaluate(algo)
            self._check_metric()
            while (state := self._next(turn)) is not None:
                self._step(state)
                it = state.runner.ctx.step
                rec = state.iters[-1]
                self.log(
                    f"[bench] {state.tag:>13} it {it:3d} {rec.wall_s:6.2f}s (total {state.cumulative_s:7.1f}s)"
                    f" reward {rec.reward:.3f} rows {rec.rollout_forwards}+{rec.train_forwards}"
                )
                if self.spec.eval_every > 0 and it % self.spec.eval_every == 0 and not self._finished(state):
                    self._evaluate(state)
                turn += 1
            for state in self.algos:
                if not state.evals or state.evals[-1]["iteration"] != state.runner.ctx.step:
                    self._evaluate(state)
            status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self._close(status)
        result = self.result()
        write_outputs(result, self.out)
        return result

    def _check_metric(self) -> None:
        """Fail before training when ``bench.metric`` names a held-out metric the evaluator does not return."""
        metric = self.spec.metric
        if metric is None:
            return
        missing = [a.key for a in self.algos if not a.evals or metric not in a.evals[0]]
        if missing:
            found = sorted({k for a in self.algos for e in a.evals for k in e if k.startswith("eval/")})
            raise RecipeError(
                [f"bench.metric: {metric!r} is not among the held-out metrics of {missing} (found: {found or 'none'})"]
            )

    def _close(self, status: str) -> None:
        """Checkpoint, summary, logger close and ``rlpost_after_run`` (reports) for every runner."""
        self.host.unregister_plugin("rlpost.bench.probe")
        for state in self.algos:
            runner = state.runner
            try:
                if runner.ctx.step > 0 and state.recipe.checkpoint.at_end:
                    runner.save_checkpoint("end")
            except Exception as exc:  # noqa: BLE001 - a failed checkpoint must not lose the measurements
                warnings.warn(f"bench: checkpoint of {state.spec.name} failed: {exc}", UserWarning, stacklevel=2)
            runner.rundir.write_summary(status, runner.ctx.step, runner.ctx.history)
            if runner.logger is not None:
                runner.logger.close()
            self.host.hook.rlpost_after_run(run=runner.ctx, status=status)

    # ------------------------------------------------------------------------------------------------ results
    def result(self) -> dict[str, Any]:
        """Everything measured and predicted, per run and aggregated over seeds, as a JSON-ready dict."""
        assert self.calibration is not None
        runs = {state.key: self._run_result(state, self.calibration) for state in self.algos}
        spec = self.spec
        out: dict[str, Any] = {
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
            },
            "calibration": vars(self.calibration),
            "peak_rss_gb_process": _peak_rss_gb(),
            "bench_wall_s": time.perf_counter() - self.started,
            "runs": runs,
        }
        out = json_safe(out)
        out["algorithms"] = aggregate(out)
        out["comparisons"] = comparisons(out)
        return json_safe(out)  # type: ignore[no-any-return]

    @staticmethod
    def _run_result(state: AlgoState, calib: Calibration) -> dict[str, Any]:
        """One (algorithm, seed) run: per-iteration records, evaluations and their summaries."""
        walls = [r.wall_s for r in state.iters]
        med, q1, q3 = _median_iqr(walls)
        phases = {p: statistics.mean(r.phases[p] for r in state.iters) if state.iters else math.nan for p in PHASES}
        mean_wall = statistics.mean(walls) if walls else math.nan
        modelled = sum(phases[p] for p in PHASES if p != "optimizer")
        overhead = mean_wall - modelled
        counted_roll = [r.rollout_forwards for r in state.iters]
        counted_train = [r.train_forwards for r in state.iters]
        pred_roll = [r.predicted["rollout_forwards"] for r in state.iters]
        pred_train = [r.predicted["train_forwards"] for r in state.iters]
        peaks = [r.peak_mem_gb for r in state.iters if r.peak_mem_gb is not None]
        return {
            "algorithm": state.spec.name,
            "seed": state.seed,
            "label": state.spec.label,
            "preset": state.spec.preset,
            "run_dir": str(state.recipe.run.output_dir),
            "train_rewards": [str(getattr(r, "name", "")) for r in state.recipe.rewards],
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
            "images_per_iter": statistics.mean(r.images for r in state.iters) if state.iters else math.nan,
            "trainable_edges_per_iter": (
                statistics.mean(r.trainable_edges for r in state.iters) if state.iters else math.nan
            ),
            "rollout_forwards": {
                "counted_mean": _mean(counted_roll),
                "predicted_mean": _mean(pred_roll),
                "predicted_expected": predicted_counts(state.recipe)["rollout_forwards_expected"],
                "all_equal": counted_roll == [int(v) for v in pred_roll],
            },
            "train_forwards": {
                "counted_mean": _mean(counted_train),
                "predicted_mean": _mean(pred_train),
                "all_equal": counted_train == [int(v) for v in pred_train],
            },
            "phases_mean_s": phases,
            "overhead_s": overhead,
            "overhead_fraction": overhead / mean_wall if mean_wall else math.nan,
            "predicted_s_per_iter": predict_seconds(state.recipe, calib),
            "peak_mem_gb": max(peaks) if peaks else None,
            "evals": state.evals,
            "iters": [vars(r) for r in state.iters],
        }


def _mean(values: Sequence[float | None]) -> float:
    xs = [float(v) for v in values if v is not None]
    return float(statistics.mean(xs)) if xs else math.nan


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import os

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


# ------------------------------------------------------------------------------------ aggregation over seeds


def eval_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric ``eval/...`` entries of an evaluator's result, whatever sets and judges it reports."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k.startswith("eval/") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _numeric(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def upgrade_legacy(result: dict[str, Any]) -> dict[str, Any]:
    """A ``bench.json`` written before seeds existed (``algorithms`` holding single runs, no ``runs``) as one run per
    algorithm with the recipe's seed (recorded as 0), so ``--report-only`` can re-render it."""
    if "runs" in result:
        return result
    algos = result.get("algorithms", {})
    result["runs"] = {run_key(n, 0): {**a, "algorithm": n, "seed": 0} for n, a in algos.items()}
    spec = result.setdefault("spec", {})
    spec.setdefault("algorithms", [{"name": n, "label": a.get("label", n)} for n, a in algos.items()])
    return result


def _runs_by_algorithm(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by algorithm in the spec's order, each list sorted by seed."""
    runs = result.get("runs") or {}
    order = [a["name"] for a in result.get("spec", {}).get("algorithms", [])]
    grouped: dict[str, list[dict[str, Any]]] = {}
    for name in order:
        grouped[name] = []
    for run in runs.values():
        grouped.setdefault(run["algorithm"], []).append(run)
    return {n: sorted(rs, key=lambda r: int(r["seed"])) for n, rs in grouped.items() if rs}


def eval_keys(result: dict[str, Any]) -> list[str]:
    """Every numeric held-out metric any run reported (each prompt set and judge is its own key), sorted."""
    keys = {
        k
        for runs in _runs_by_algorithm(result).values()
        for run in runs
        for e in run["evals"]
        for k, v in e.items()
        if k.startswith("eval/") and _numeric(v) is not None
    }
    return sorted(keys)


def primary_metric(result: dict[str, Any]) -> str | None:
    """The held-out metric reward levels are defined on: ``bench.metric``, else ``eval/<first training reward>``
    when the evaluator reports it, else the first key in sorted order."""
    keys = eval_keys(result)
    chosen = result.get("spec", {}).get("metric")
    if chosen:
        return str(chosen) if chosen in keys else None
    for runs in _runs_by_algorithm(result).values():
        for name in runs[0].get("train_rewards", []):
            if f"eval/{name}" in keys:
                return f"eval/{name}"
    return keys[0] if keys else None


def _stats_kwargs(result: dict[str, Any]) -> dict[str, Any]:
    boot = result.get("spec", {}).get("bootstrap") or {}
    return {
        "resamples": int(boot.get("resamples", bs.DEFAULT_RESAMPLES)),
        "confidence": float(boot.get("confidence", bs.DEFAULT_CONFIDENCE)),
        "seed": int(boot.get("seed", 0)),
    }


def _paper_value(result: dict[str, Any], quantity: str, name: str) -> float | None:
    section = (result.get("spec", {}).get("paper") or {}).get(quantity) or {}
    return _numeric((section.get("values") or {}).get(name))


def aggregate(result: dict[str, Any]) -> dict[str, Any]:
    """Per algorithm: its seeds' runs summarised (s/iter over per-seed medians with a bootstrap interval; counts,
    phases and the cost model pooled over seeds, which run the same recipe)."""
    kw = _stats_kwargs(result)
    out: dict[str, Any] = {}
    for name, runs in _runs_by_algorithm(result).items():
        first = runs[0]
        pooled_walls = [float(it["wall_s"]) for r in runs for it in r.get("iters", [])]
        med, q1, q3 = _median_iqr(pooled_walls)
        pred_keys = (
            "rollout_forward_s",
            "train_fwd_bwd_s",
            "decode_reward_s",
            "total_s",
            "rollout_batch",
            "train_batch",
        )
        out[name] = {
            "label": first["label"],
            "preset": first.get("preset", name),
            "seeds": [int(r["seed"]) for r in runs],
            "runs": [run_key(name, int(r["seed"])) for r in runs],
            "iterations": [int(r["iterations"]) for r in runs],
            "train_time_s": [float(r["train_time_s"]) for r in runs],
            "s_per_iter": bs.summarize([r["s_per_iter"]["median"] for r in runs], **kw),
            "s_per_iter_pooled": {"median": med, "q1": q1, "q3": q3},
            "images_per_iter": _mean([r["images_per_iter"] for r in runs]),
            "trainable_edges_per_iter": _mean([r["trainable_edges_per_iter"] for r in runs]),
            "rollout_forwards": {
                "counted_mean": _mean([r["rollout_forwards"]["counted_mean"] for r in runs]),
                "predicted_mean": _mean([r["rollout_forwards"]["predicted_mean"] for r in runs]),
                "predicted_expected": _mean([r["rollout_forwards"]["predicted_expected"] for r in runs]),
                "all_equal": all(r["rollout_forwards"]["all_equal"] for r in runs),
            },
            "train_forwards": {
                "counted_mean": _mean([r["train_forwards"]["counted_mean"] for r in runs]),
                "predicted_mean": _mean([r["train_forwards"]["predicted_mean"] for r in runs]),
                "all_equal": all(r["train_forwards"]["all_equal"] for r in runs),
            },
            "phases_mean_s": {p: _mean([r["phases_mean_s"].get(p) for r in runs]) for p in PHASES},
            "overhead_s": _mean([r["overhead_s"] for r in runs]),
            "overhead_fraction": _mean([r["overhead_fraction"] for r in runs]),
            "predicted_s_per_iter": {k: _mean([r["predicted_s_per_iter"].get(k) for r in runs]) for k in pred_keys},
            "peak_mem_gb": max((r["peak_mem_gb"] for r in runs if r.get("peak_mem_gb") is not None), default=None),
            "paper_s_per_iter": _paper_value(result, "s_per_iter", name),
        }
    return out


def _at_iteration(run: dict[str, Any], key: str, iteration: int) -> float | None:
    hits = [e for e in run["evals"] if int(e["iteration"]) == iteration]
    return _numeric(hits[0].get(key)) if hits else None


def _at_time(run: dict[str, Any], t: float) -> dict[str, Any] | None:
    """The run's last evaluation at or before training time ``t``."""
    hits = [e for e in run["evals"] if float(e["train_time_s"]) <= t + 1e-9]
    return hits[-1] if hits else None


def _best(run: dict[str, Any], key: str) -> float | None:
    values = [v for e in run["evals"] if (v := _numeric(e.get(key))) is not None]
    return max(values) if values else None


def _final(run: dict[str, Any], key: str) -> float | None:
    values = [v for e in run["evals"] if (v := _numeric(e.get(key))) is not None]
    return values[-1] if values else None


def _time_to(runs: list[dict[str, Any]], key: str, level: float, kw: dict[str, Any]) -> dict[str, Any]:
    hits = [bs.first_reach(r["evals"], key, level) for r in runs]
    times = [float(h["train_time_s"]) if h else None for h in hits]
    return {
        "n": len(runs),
        "reached": sum(h is not None for h in hits),
        "times_s": times,
        "iterations": [int(h["iteration"]) if h else None for h in hits],
        # Over the seeds that reached the level; the report flags any seed that did not.
        "time_s": bs.summarize(times, **kw),
    }


def comparisons(result: dict[str, Any]) -> dict[str, Any]:
    """Held-out metrics at equal iterations and equal wall time, reward levels, ratios and the stated conclusions.

    * Equal iterations: the largest iteration at which every run was evaluated.
    * Equal wall time: the smallest total training time among the runs; each run's last evaluation at or before it.
    * Reward levels (on :func:`primary_metric`): ``best`` = the lowest of the reference's per-seed best values,
      ``final`` = the lowest of its per-seed final values, so every reference seed reaches both; each run's time to
      its first evaluation at or above the level (``None``: not reached).
    * Ratios, for every fast algorithm: reference / fast for s/iter and for time to each level (bootstrap over the
      seeds of both; a time ratio only when every seed of both reached the level), the cost model's and the counted
      rows' ratios, and the paper's.
    * Conclusions: one sentence per quantity and algorithm against the reference; a direction only where the
      intervals separate (:func:`rlpost.bench_stats.compare`).
    """
    by_algo = _runs_by_algorithm(result)
    algos = result.get("algorithms") or aggregate(result)
    spec = result.get("spec", {})
    kw = _stats_kwargs(result)
    out: dict[str, Any] = {}
    all_runs = [r for runs in by_algo.values() for r in runs]
    if not all_runs:
        return out
    keys = eval_keys(result)
    metric = primary_metric(result)
    common = set.intersection(*({int(e["iteration"]) for e in r["evals"]} for r in all_runs))
    n_eq = max(common) if common else 0
    t_eq = min(float(r["train_time_s"]) for r in all_runs)
    out["eval_keys"] = keys
    out["metric"] = metric
    out["equal_iterations"] = {"iteration": n_eq, "heldout": {}}
    out["equal_wall_time"] = {"train_time_s": t_eq, "heldout": {}, "iterations": {}}
    out["before_after"] = {}
    for key in keys:
        eq_it, eq_t, ba = {}, {}, {}
        for name, runs in by_algo.items():
            eq_it[name] = bs.summarize([_at_iteration(r, key, n_eq) for r in runs], **kw)
            recs = [_at_time(r, t_eq) for r in runs]
            eq_t[name] = bs.summarize([_numeric(x.get(key)) if x else None for x in recs], **kw)
            out["equal_wall_time"]["iterations"][name] = [int(x["iteration"]) if x else None for x in recs]
            ba[name] = {
                "before": bs.summarize([_numeric(r["evals"][0].get(key)) if r["evals"] else None for r in runs], **kw),
                "after": bs.summarize([_final(r, key) for r in runs], **kw),
                "best": bs.summarize([_best(r, key) for r in runs], **kw),
            }
        out["equal_iterations"]["heldout"][key] = eq_it
        out["equal_wall_time"]["heldout"][key] = eq_t
        out["before_after"][key] = ba
    reference = spec.get("reference")
    fast = _as_names(spec.get("fast"))
    if metric is not None and reference in by_algo:
        ref_runs = by_algo[reference]
        levels: dict[str, Any] = {}
        for level_name, per_seed in (
            ("best", [_best(r, metric) for r in ref_runs]),
            ("final", [_final(r, metric) for r in ref_runs]),
        ):
            values = [v for v in per_seed if v is not None]
            if not values:
                continue
            level = min(values)
            levels[level_name] = {
                "metric": metric,
                "level": level,
                "reference_per_seed": per_seed,
                "by_algorithm": {name: _time_to(runs, metric, level, kw) for name, runs in by_algo.items()},
            }
        out["levels"] = levels
    out["ratios"] = {}
    if reference in by_algo:
        ref_med = [r["s_per_iter"]["median"] for r in by_algo[reference]]
        for f in fast:
            if f not in by_algo:
                continue
            fa, ra = algos[f], algos[reference]
            entry: dict[str, Any] = {
                "fast": f,
                "reference": reference,
                "s_per_iter": bs.ratio_summary(ref_med, [r["s_per_iter"]["median"] for r in by_algo[f]], **kw),
            }
            pred_f, pred_r = fa["predicted_s_per_iter"]["total_s"], ra["predicted_s_per_iter"]["total_s"]
            entry["cost_model"] = pred_r / pred_f if pred_f and pred_r else None
            entry["measured_vs_predicted_rel_err"] = (
                entry["s_per_iter"]["mean"] / entry["cost_model"] - 1.0
                if entry["cost_model"] and _numeric(entry["s_per_iter"]["mean"]) is not None
                else None
            )
            rows_f = fa["rollout_forwards"]["counted_mean"] + fa["train_forwards"]["counted_mean"]
            rows_r = ra["rollout_forwards"]["counted_mean"] + ra["train_forwards"]["counted_mean"]
            entry["counted_rows"] = rows_r / rows_f if rows_f else None
            entry["s_per_iter_vs_1"] = bs.verdict(entry["s_per_iter"], (1.0, 1.0))
            for qty in PAPER_QUANTITIES:
                p_f, p_r = _paper_value(result, qty, f), _paper_value(result, qty, reference)
                paper = p_r / p_f if p_f and p_r else None
                entry[f"paper_{qty}"] = paper
            paper_s = entry["paper_s_per_iter"]
            entry["s_per_iter_vs_paper"] = (
                bs.verdict(entry["s_per_iter"], (paper_s, paper_s)) if paper_s is not None else None
            )
            entry["time_to_level"] = {}
            for level_name, lv in out.get("levels", {}).items():
                tf, tr = lv["by_algorithm"][f], lv["by_algorithm"][reference]
                if tf["reached"] < tf["n"] or tr["reached"] < tr["n"]:
                    entry["time_to_level"][level_name] = {
                        "not_reached": f"{f} {tf['reached']}/{tf['n']} seeds, {reference} {tr['reached']}/{tr['n']}"
                    }
                    continue
                ratio = bs.ratio_summary(tr["times_s"], tf["times_s"], **kw)
                ratio["vs_1"] = bs.verdict(ratio, (1.0, 1.0))
                entry["time_to_level"][level_name] = ratio
            out["ratios"][f] = entry
    out["conclusions"] = _conclusions(result, algos, out, by_algo)
    return out


def _conclusions(
    result: dict[str, Any], algos: dict[str, Any], comp: dict[str, Any], by_algo: dict[str, list[dict[str, Any]]]
) -> list[str]:
    """Every algorithm against the reference: s/iter, each held-out metric at equal iterations and at equal wall
    time, time to the reference's best level; a direction only where the intervals separate."""
    reference = result.get("spec", {}).get("reference")
    if reference not in by_algo:
        return []

    def tag(name: str) -> str:
        a = algos[name]
        return f"{a['label']} [{a['preset']}]"

    lines: list[str] = []
    ref = tag(reference)
    for name in by_algo:
        if name == reference:
            continue
        me = tag(name)
        lines.append(
            bs.compare(
                me,
                algos[name]["s_per_iter"],
                ref,
                algos[reference]["s_per_iter"],
                quantity="s/iter",
                higher="slower",
                lower="faster",
            )
        )
        for key in comp["eval_keys"]:
            eq_it = comp["equal_iterations"]["heldout"][key]
            eq_t = comp["equal_wall_time"]["heldout"][key]
            lines.append(
                bs.compare(
                    me,
                    eq_it[name],
                    ref,
                    eq_it[reference],
                    quantity=f"{key} at iteration {comp['equal_iterations']['iteration']}",
                )
            )
            lines.append(
                bs.compare(
                    me,
                    eq_t[name],
                    ref,
                    eq_t[reference],
                    quantity=f"{key} at {comp['equal_wall_time']['train_time_s']:.0f} s",
                )
            )
        best = comp.get("levels", {}).get("best")
        if best:
            mine, theirs = best["by_algorithm"][name], best["by_algorithm"][reference]
            quantity = f"time to {best['metric']} >= {best['level']:.4f}"
            if mine["reached"] < mine["n"]:
                lines.append(f"{quantity}: {me} not reached in {mine['n'] - mine['reached']} of {mine['n']} seeds")
            else:
                lines.append(
                    bs.compare(
                        me, mine["time_s"], ref, theirs["time_s"], quantity=quantity, higher="slower", lower="faster"
                    )
                )
    return lines


# ------------------------------------------------------------------------------------------------- outputs


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def _ci(summary: dict[str, Any] | None, spec: str = ".3f") -> str:
    """``mean [lo–hi] (min–max, n=N)`` of a :func:`rlpost.bench_stats.summarize` result; a bare value for n=1."""
    if not summary or not summary.get("n"):
        return "–"
    mean = _fmt(summary["mean"], spec)
    if summary["n"] == 1:
        return f"{mean} (n=1)"
    if summary["min"] == summary["max"]:
        return f"{mean} (n={summary['n']}, all equal)"
    return (
        f"{mean} [{_fmt(summary['lo'], spec)}–{_fmt(summary['hi'], spec)}] "
        f"({_fmt(summary['min'], spec)}–{_fmt(summary['max'], spec)}, n={summary['n']})"
    )


def _ratio(summary: dict[str, Any] | None) -> str:
    if not summary or _numeric(summary.get("mean")) is None:
        return "–"
    body = f"{summary['mean']:.2f}x"
    if _numeric(summary.get("lo")) is not None and summary["lo"] != summary["hi"]:
        body += f" [{summary['lo']:.2f}–{summary['hi']:.2f}] ({summary['min']:.2f}–{summary['max']:.2f})"
    return body


def _times(value: Any) -> str:
    """A ratio as ``2.41x`` (``–`` when absent)."""
    return "–" if _numeric(value) is None else f"{value:.2f}x"


def _vs(summary: dict[str, Any] | None, point: float | None) -> str:
    """Whether an interval excludes ``point``, with the side it lies on when it does."""
    if not summary or point is None or _numeric(summary.get("mean")) is None:
        return "–"
    if bs.verdict(summary, (point, point)) != "separated":
        return f"includes {point:.2f}"
    return f"excludes {point:.2f} ({'above' if summary['mean'] > point else 'below'})"


def _paper_cell(paper: dict[str, Any], qty: str, name: str, marks: dict[str, int]) -> str:
    section = paper.get(qty) or {}
    value = _numeric((section.get("values") or {}).get(name))
    if value is None:
        return "–"
    note = (section.get("notes") or {}).get(name)
    if not note:
        return f"{value:.1f}"
    mark = marks.setdefault(f"{qty}:{name}", len(marks) + 1)
    return f"{value:.1f} [{mark}]"


def markdown(result: dict[str, Any]) -> str:
    """The bench report: Table-1-shaped summary, held-out tables (every ``eval/`` metric), reference/fast ratios
    next to the paper's, time to the reference's reward level, conclusions, counts, cost model, phases."""
    algos, comp, m, spec = result["algorithms"], result.get("comparisons", {}), result["machine"], result["spec"]
    paper = spec.get("paper") or {}
    eq_it, eq_t = comp.get("equal_iterations", {}), comp.get("equal_wall_time", {})
    metric = comp.get("metric")
    boot = spec.get("bootstrap") or {}
    conf = 100 * float(boot.get("confidence", bs.DEFAULT_CONFIDENCE))
    seeds = spec.get("seeds")
    lines = [
        "# rlpost bench",
        "",
        f"Machine: {m['platform']}, {m['nproc']} CPUs (torch threads {m['torch_threads']}), torch {m['torch']}, "
        f"CUDA {'yes: ' + m.get('gpu', '') if m['cuda'] else 'no'}. Schedule {spec['schedule']}, "
        + (
            f"time budget {spec['time_budget_s']:g} s of training per algorithm and seed"
            if spec.get("time_budget_s") is not None
            else "no time budget"
        )
        + f", max {spec['max_iterations']} "
        f"iterations. Training seeds {seeds if seeds is not None else 'from each recipe'}. "
        f"Bench wall time {result['bench_wall_s']:.0f} s.",
        "",
        f"Numbers over seeds read `mean [lo–hi] (min–max, n)`: the mean over training seeds, a {conf:.0f} % "
        f"percentile bootstrap interval of it ({boot.get('resamples', bs.DEFAULT_RESAMPLES)} resamples of the seeds, "
        "RNG seed "
        f"{boot.get('seed', 0)}) and the smallest and largest seed. Two results are called different only where "
        'their intervals do not overlap ("separated"); otherwise "not separated". The *preset* column names the '
        "bench recipe entry that produced each row.",
        "",
        "## Table 1 (shape of the TreeGRPO paper's)",
        "",
        f"Held-out columns: `{metric or '–'}`"
        + (
            f"; paper numbers: {paper['source']}, {(paper.get('s_per_iter') or {}).get('source', '')}."
            if paper.get("source")
            else "."
        ),
        "",
        f"| Method | preset | s/iter | paper s/iter | iterations per seed | held-out before | "
        f"held-out @ it {eq_it.get('iteration')} | held-out @ {_fmt(eq_t.get('train_time_s'), '.0f')} s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    marks: dict[str, int] = {}
    for name, a in algos.items():
        ba = (comp.get("before_after", {}).get(metric) or {}).get(name, {})
        lines.append(
            f"| {a['label']} | {a['preset']} | {_ci(a['s_per_iter'], '.2f')} | "
            f"{_paper_cell(paper, 's_per_iter', name, marks)} | {', '.join(str(i) for i in a['iterations'])} | "
            f"{_ci(ba.get('before'), '.4f')} | "
            f"{_ci((eq_it.get('heldout', {}).get(metric) or {}).get(name), '.4f')} | "
            f"{_ci((eq_t.get('heldout', {}).get(metric) or {}).get(name), '.4f')} |"
        )
    notes = [(mark, key) for key, mark in marks.items()]
    if notes or paper.get("notes"):
        lines.append("")
        for mark, key in sorted(notes):
            qty, name = key.split(":", 1)
            lines.append(f"[{mark}] {paper[qty]['notes'][name]}")
        for name, note in (paper.get("notes") or {}).items():
            lines.append(f"* {algos[name]['label'] if name in algos else name} [{name}]: {note}")
    lines += _heldout_tables(algos, comp)
    lines += _ratio_table(result, algos, comp)
    lines += _level_tables(result, algos, comp)
    if comp.get("conclusions"):
        lines += ["", "## Conclusions (a direction only where the intervals separate)", ""]
        lines += [f"* {c}" for c in comp["conclusions"]]
    lines += [
        "",
        "## Work per iteration: counted (policy.forward_count) vs cost model (Sampler.counts), all seeds pooled",
        "",
        "| Method | preset | images | trainable edges | rollout fwd counted | rollout fwd predicted | "
        "train fwd+bwd counted | train fwd+bwd predicted | counts match (every iteration of every seed) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for a in algos.values():
        rf, tf = a["rollout_forwards"], a["train_forwards"]
        lines.append(
            f"| {a['label']} | {a['preset']} | {_fmt(a['images_per_iter'], '.0f')} | "
            f"{_fmt(a['trainable_edges_per_iter'], '.0f')} | "
            f"{_fmt(rf['counted_mean'], '.1f')} | {_fmt(rf['predicted_mean'], '.1f')} "
            f"(E={_fmt(rf['predicted_expected'], '.1f')}) | {_fmt(tf['counted_mean'], '.1f')} | "
            f"{_fmt(tf['predicted_mean'], '.1f')} | {'yes' if rf['all_equal'] and tf['all_equal'] else 'NO'} |"
        )
    c = result["calibration"]
    lines += [
        "",
        "## Time cost model (calibrated on this machine)",
        "",
        "Per-row seconds: "
        + ", ".join(
            f"B={b}: fwd {f * 1e3:.2f} ms, fwd+bwd {fb * 1e3:.2f} ms"
            for b, f, fb in zip(c["batch_sizes"], c["forward_s_per_row"], c["fwd_bwd_s_per_row"], strict=True)
        )
        + f"; decode+reward {c['decode_reward_s_per_image'] * 1e3:.2f} ms per image.",
        "",
        "| Method | preset | rollout batch | train batch | predicted rollout s | predicted train s | "
        "predicted decode+reward s | predicted s/iter | measured s/iter (mean of seeds' medians) | "
        "measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in algos.values():
        p = a["predicted_s_per_iter"]
        measured = _numeric(a["s_per_iter"].get("mean"))
        lines.append(
            f"| {a['label']} | {a['preset']} | {_fmt(p['rollout_batch'], '.0f')} | {_fmt(p['train_batch'], '.1f')} | "
            f"{_fmt(p['rollout_forward_s'], '.2f')} | {_fmt(p['train_fwd_bwd_s'], '.2f')} | "
            f"{_fmt(p['decode_reward_s'], '.2f')} | {_fmt(p['total_s'], '.2f')} | {_fmt(measured, '.2f')}"
            f" | {_fmt(measured / p['total_s'] if measured is not None and p['total_s'] else None, '.2f')} |"
        )
    lines += [
        "",
        "## Where an iteration's time goes (mean seconds per iteration, seeds pooled)",
        "",
        "| Method | preset | rollout fwd | train fwd | backward | decode | reward | optimizer step | "
        "other (overhead) | overhead share |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in algos.values():
        ph = a["phases_mean_s"]
        lines.append(
            f"| {a['label']} | {a['preset']} | {_fmt(ph['rollout_forward'], '.2f')} | "
            f"{_fmt(ph['train_forward'], '.2f')} | "
            f"{_fmt(ph['backward'], '.2f')} | {_fmt(ph['decode'], '.3f')} | {_fmt(ph['reward'], '.3f')} | "
            f"{_fmt(ph['optimizer'], '.3f')} | {_fmt(a['overhead_s'], '.2f')} | "
            f"{_fmt(100 * a['overhead_fraction'] if a['overhead_fraction'] is not None else None, '.1f')} % |"
        )
    mem = [a["peak_mem_gb"] for a in algos.values() if a["peak_mem_gb"] is not None]
    lines += [""]
    if mem:
        lines.append(
            "Peak CUDA memory allocated per iteration (includes every run's resident weights): "
            + ", ".join(f"{a['label']} [{a['preset']}] {_fmt(a['peak_mem_gb'], '.2f')} GiB" for a in algos.values())
        )
    else:
        lines.append(
            f"Peak memory: no GPU; process peak RSS {result['peak_rss_gb_process']:.2f} GiB, **shared by all "
            "interleaved runs** (one process holds every model), so it is not a per-algorithm number."
        )
    return "\n".join(lines) + "\n"


def _heldout_tables(algos: dict[str, Any], comp: dict[str, Any]) -> list[str]:
    """One table per held-out metric (each prompt set and judge the evaluator reports)."""
    eq_it, eq_t = comp.get("equal_iterations", {}), comp.get("equal_wall_time", {})
    lines = ["", "## Held-out evaluation (every `eval/` metric)", ""]
    if not comp.get("eval_keys"):
        return [*lines, "_no held-out evaluation recorded_"]
    for key in comp["eval_keys"]:
        ba = comp["before_after"][key]
        lines += [
            f"### `{key}`",
            "",
            f"| Method | preset | before | after | best | @ it {eq_it.get('iteration')} | "
            f"@ {_fmt(eq_t.get('train_time_s'), '.0f')} s | iteration of the @ "
            f"{_fmt(eq_t.get('train_time_s'), '.0f')} s value, per seed |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for name, a in algos.items():
            its = eq_t.get("iterations", {}).get(name) or []
            lines.append(
                f"| {a['label']} | {a['preset']} | {_ci(ba[name]['before'], '.4f')} | "
                f"{_ci(ba[name]['after'], '.4f')} | "
                f"{_ci(ba[name]['best'], '.4f')} | {_ci(eq_it['heldout'][key].get(name), '.4f')} | "
                f"{_ci(eq_t['heldout'][key].get(name), '.4f')} | {', '.join(_fmt(i, 'd') for i in its)} |"
            )
        lines.append("")
    return lines


def _ratio_table(result: dict[str, Any], algos: dict[str, Any], comp: dict[str, Any]) -> list[str]:
    """Reference / fast ratios (s/iter, time to each level) next to the paper's and the cost model's."""
    ratios = comp.get("ratios") or {}
    if not ratios:
        return []
    paper = result["spec"].get("paper") or {}
    ref = result["spec"].get("reference")
    ref_label = algos[ref]["label"] if ref in algos else ref
    levels = list((comp.get("levels") or {}).keys())
    lines = [
        "",
        f"## {ref_label} / fast ratios (how many times faster; > 1 favours the fast algorithm)",
        "",
        "Intervals bootstrap the seeds of both algorithms independently. *vs 1* / *vs paper*: whether the ratio's "
        "interval excludes 1 / the paper's ratio. The conclusions below use the stricter rule (the two algorithms' "
        "own intervals must not overlap), so a ratio interval that excludes 1 while those overlap is suggestive, not "
        "a stated difference."
        + (f" Paper s/iter: {(paper.get('s_per_iter') or {}).get('source', '')}." if paper.get("s_per_iter") else "")
        + (
            f" Paper time to reward: {paper['time_to_reward'].get('source', '')}."
            if paper.get("time_to_reward")
            else ""
        ),
        "",
        "| Fast | preset | s/iter ratio | vs 1 | paper s/iter ratio | vs paper | cost model | counted rows | "
        + " | ".join(f"time to `{lv}` level ratio" for lv in levels)
        + (" | " if levels else "")
        + "paper time-to-reward ratio |",
        "|---|---|---:|---|---:|---|---:|---:|" + "---:|" * len(levels) + "---:|",
    ]
    for f, r in ratios.items():
        cells = []
        for lv in levels:
            t = r["time_to_level"].get(lv) or {}
            cells.append(f"not reached ({t['not_reached']})" if "not_reached" in t else f"{_ratio(t)}, {_vs(t, 1.0)}")
        lines.append(
            f"| {algos[f]['label']} | {algos[f]['preset']} | {_ratio(r['s_per_iter'])} | {_vs(r['s_per_iter'], 1.0)} | "
            f"{_times(r.get('paper_s_per_iter'))} | {_vs(r['s_per_iter'], r.get('paper_s_per_iter'))} | "
            f"{_times(r.get('cost_model'))} | {_times(r.get('counted_rows'))} | "
            + " | ".join(cells)
            + (" | " if cells else "")
            + f"{_times(r.get('paper_time_to_reward'))} |"
        )
    return lines


def _level_tables(result: dict[str, Any], algos: dict[str, Any], comp: dict[str, Any]) -> list[str]:
    """Time for every algorithm to first reach the reference's best and final held-out levels."""
    levels = comp.get("levels") or {}
    ref = result["spec"].get("reference")
    lines: list[str] = []
    for level_name, lv in levels.items():
        lines += [
            "",
            f"## Time to reach {algos[ref]['label']}'s {level_name} level: `{lv['metric']}` >= {lv['level']:.4f}",
            "",
            f"The lowest of {algos[ref]['label']} [{algos[ref]['preset']}]'s per-seed {level_name} values "
            f"({', '.join(_fmt(v, '.4f') for v in lv['reference_per_seed'])}), so every seed of it reaches the "
            "level. Time is accumulated training time at the first evaluation at or above it (resolution: "
            + (
                f"every {result['spec']['eval_every']} iterations"
                if result["spec"].get("eval_every")
                else "evaluations only before and after training"
            )
            + "). Means are over the seeds that reached it.",
            "",
            "| Method | preset | reached | time (s) | iteration per seed |",
            "|---|---|---:|---:|---|",
        ]
        for name, t in lv["by_algorithm"].items():
            reached = f"{t['reached']}/{t['n']}" + ("" if t["reached"] == t["n"] else " (**not reached** by all)")
            lines.append(
                f"| {algos[name]['label']} | {algos[name]['preset']} | {reached} | {_ci(t['time_s'], '.1f')} | "
                + ", ".join("not reached" if i is None else str(i) for i in t["iterations"])
                + " |"
            )
    return lines


def plot_wallclock(result: dict[str, Any], out: Path) -> Path | None:
    """Held-out metrics against accumulated training time: one panel per ``eval/`` metric, one colour per
    algorithm, one line per seed (matplotlib, Agg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("rlpost bench: matplotlib is not installed; skipping the plot", UserWarning, stacklevel=2)
        return None
    keys = eval_keys(result) or ["eval/"]
    by_algo = _runs_by_algorithm(result)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7.0, 3.6 * len(keys)), dpi=110, squeeze=False)
    try:
        for ax, key in zip(axes[:, 0], keys, strict=True):
            for i, (name, runs) in enumerate(by_algo.items()):
                first = runs[0]
                for j, run in enumerate(runs):
                    pts = [
                        (float(e["train_time_s"]), v) for e in run["evals"] if (v := _numeric(e.get(key))) is not None
                    ]
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            marker="o",
                            markersize=2.5,
                            linewidth=1.0,
                            alpha=0.75,
                            color=f"C{i}",
                            label=f"{first['label']} [{first.get('preset', name)}]" if j == 0 else None,
                        )
            ax.set_xlabel("accumulated training time (s, evaluations excluded)")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=7)
        axes[0, 0].set_title("rlpost bench: held-out metrics vs wall clock (one line per seed)")
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def write_outputs(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md``, ``reward_vs_wallclock.png``, and each run's ``bench_run.json`` (in its
    run directory, when that exists)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    for key, run in (result.get("runs") or {}).items():
        run_dir = out / key
        if run_dir.is_dir():
            (run_dir / "bench_run.json").write_text(json.dumps(run, indent=2) + "\n")
    paths["markdown"].write_text(markdown(result))
    plot = plot_wallclock(result, out / "reward_vs_wallclock.png")
    if plot is not None:
        paths["plot"] = plot
    return paths


# ----------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str]) -> int:
    """``rlpost bench --recipe BENCH.yaml [--out DIR] [--bench.KEY VALUE ...]``."""
    parser = argparse.ArgumentParser(prog="rlpost bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", help="bench recipe (e.g. recipes/bench/digits.yaml)")
    parser.add_argument("--out", default=None, help="output directory (default: bench.output_dir)")
    parser.add_argument(
        "--report-only", metavar="DIR", help="re-render DIR/bench.md and the plot from DIR/bench.json (no training)"
    )
    ns, rest = parser.parse_known_args(list(argv))
    if ns.report_only:
        out = Path(ns.report_only)
        result = upgrade_legacy(json.loads((out / "bench.json").read_text()))
        result["algorithms"] = json_safe(aggregate(result))
        result["comparisons"] = json_safe(comparisons(result))
        write_outputs(result, out)
        print(markdown(result))
        return 0
    if not ns.recipe:
        parser.error("--recipe is required (or --report-only DIR)")
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or i + 1 >= len(rest):
            parser.error(f"unexpected argument {token!r} (overrides look like --bench.KEY VALUE)")
        overrides.append((token[2:], rest[i + 1]))
        i += 2
    spec = load_bench(ns.recipe, overrides)
    if ns.out is not None:
        spec.output_dir = ns.out
    result = Bench(spec).run()
    out = Path(spec.output_dir)
    print(markdown(result))
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'} and {out / 'reward_vs_wallclock.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
