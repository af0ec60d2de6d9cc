"""``rlpost bench``: TreeGRPO, DanceGRPO, MixGRPO and DDPO side by side, in one process, interleaved step by step.

A bench recipe (``recipes/bench/digits.yaml``) names a shared base recipe and one overlay per algorithm::

    bench:
      output_dir: runs/bench-digits      # one run directory per algorithm below it, plus the tables and the plot
      base: [recipes/bench/digits/base.yaml]
      schedule: least-time               # or round-robin
      time_budget_s: 120                 # per-algorithm training time (equal wall time); null = no time limit
      max_iterations: 40                 # per-algorithm cap (the only stop when time_budget_s is null)
      eval_every: 4                      # held-out evaluation every N iterations (plus 0 and the last); not timed
      reference: dancegrpo               # the "TreeGRPO reaches X's final reward in a fraction of X's time" target
      fast: treegrpo
      calibration: {repeats: 5, batch_sizes: [1, 4, 16, 64]}
    algorithms:
      - {name: treegrpo, label: TreeGRPO, recipes: [recipes/bench/digits/treegrpo.yaml]}
      - ...

Every algorithm gets its own :class:`rlpost.runner.Runner` (own policy, LoRA, optimizer, run directory); the bench
drives ``Runner.step()`` itself. With ``least-time`` it always advances the algorithm with the least accumulated
training time, so every algorithm runs in the same stretches of wall clock and background load hits all alike.
Held-out evaluations happen between steps and are excluded from the training time.

Measured per iteration: wall time, per-phase time (transformer forward in the rollout and in the update, backward,
optimizer step, VAE decode, reward scoring; the rest is overhead), transformer rows counted through the policy's
``forward_count`` before/after the rollout and the update, and peak memory. Predicted: the same counts from the
sampler's closed forms (``Sampler.counts``; TreeGRPO's rollout at the drawn window start via
``rollout_forwards_at``), and seconds per iteration from a cost model calibrated on this machine (per-row forward
and forward+backward cost at the relevant batch sizes, decode+reward per image).

Outputs (in ``bench.output_dir``): ``bench.json``, ``bench.md`` (a table shaped like the TreeGRPO paper's Table 1,
plus the cost model and phase breakdown), ``reward_vs_wallclock.png``, and each algorithm's run directory.
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

from rlpost.api import Policy, StepCounts
from rlpost.plugins import PluginHost, get_host
from rlpost.recipe import Recipe, RecipeError, merge_sources, validate
from rlpost.rundir import json_safe

__all__ = ["AlgoSpec", "BenchSpec", "Bench", "load_bench", "main"]

PAPER_S_PER_ITER = {"treegrpo": 72.0, "dancegrpo": 173.5, "mixgrpo": 145.4, "ddpo": 166.1}
"""TreeGRPO paper, Table 1 (SD3.5-M, NFE 10, 8xA100; algorithms.md §2.5)."""

PHASES = ("rollout_forward", "train_forward", "backward", "optimizer", "decode", "reward")


# ------------------------------------------------------------------------------------------------- the spec


@dataclass
class AlgoSpec:
    """One benchmarked algorithm: overlays on the shared base.

    Attributes:
        name: Short name (run directory, JSON keys).
        label: Display name in tables and plots.
        recipes: Overlay recipe files merged after the bench's base.
        overrides: ``{"a.b": value}`` applied last (as ``--a.b value``).
    """

    name: str
    label: str
    recipes: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchSpec:
    """The ``bench`` section plus the algorithms (see the module docstring)."""

    output_dir: str
    base: list[str]
    algorithms: list[AlgoSpec]
    schedule: str = "least-time"
    time_budget_s: float | None = None
    max_iterations: int = 10
    eval_every: int = 0
    reference: str | None = None
    fast: str | None = None
    calibration_repeats: int = 5
    calibration_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    overrides: dict[str, Any] = field(default_factory=dict)


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
        "schedule",
        "time_budget_s",
        "max_iterations",
        "eval_every",
        "reference",
        "fast",
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
        specs.append(
            AlgoSpec(
                str(a["name"]),
                str(a.get("label", a["name"])),
                list(a.get("recipes", [])),
                dict(a.get("overrides") or {}),
            )
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        problems.append(f"algorithms: names must be unique, got {names}")
    schedule = str(bench.get("schedule", "least-time"))
    if schedule not in ("least-time", "round-robin"):
        problems.append(f"bench.schedule: 'least-time' or 'round-robin', got {schedule!r}")
    calib = dict(bench.get("calibration") or {})
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
    )
    if spec.max_iterations < 1:
        problems.append(f"bench.max_iterations: must be >= 1, got {spec.max_iterations}")
    for key in ("reference", "fast"):
        value = getattr(spec, key)
        if value is not None and value not in names:
            problems.append(f"bench.{key}: {value!r} is not one of the algorithms {names}")
    if problems:
        raise RecipeError(problems)
    return spec


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
    """A runner and everything measured about it."""

    spec: AlgoSpec
    recipe: Recipe
    runner: Any
    timer: PhaseTimer
    iters: list[IterRecord] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    cumulative_s: float = 0.0
    setup_s: float = 0.0
    done: bool = False

    @property
    def policy(self) -> Policy:
        return self.recipe.model


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
    def build(self) -> None:
        """Validate every algorithm's merged recipe (all problems at once), then set up the runners."""
        from rlpost.runner import Runner

        taken = [self.out / a.name for a in self.spec.algorithms] + [self.out / "bench.json"]
        if any(p.exists() for p in taken):
            raise FileExistsError(f"bench output directory {self.out} already holds a bench; choose another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        problems: list[str] = []
        recipes: list[Recipe] = []
        for algo in self.spec.algorithms:
            overrides = {**self.spec.overrides, **algo.overrides}
            pairs = [(k, yaml.safe_dump(v, default_flow_style=True).strip()) for k, v in overrides.items()]
            pairs.append(("run.output_dir", str(self.out / algo.name)))
            pairs.append(("run.progress", "false"))
            try:
                cfg = merge_sources([*self.spec.base, *algo.recipes], pairs)
                # Evaluation is driven by the bench between steps (untimed); the runner must not evaluate itself.
                if isinstance(cfg.get("eval"), dict):
                    cfg["eval"]["every"] = 0
                recipes.append(validate(cfg, self.host))
            except RecipeError as exc:
                problems += [f"{algo.name}: {p}" for p in exc.problems]
        if problems:
            raise RecipeError(problems)
        self.host.register_plugin(_probe_plugin(self.probe), name="rlpost.bench.probe")
        for algo, recipe in zip(self.spec.algorithms, recipes, strict=True):
            t0 = time.perf_counter()
            runner = Runner(recipe, self.host)
            runner.setup()
            state = AlgoState(algo, recipe, runner, PhaseTimer(runner.device))
            state.setup_s = time.perf_counter() - t0
            self._instrument(state)
            self.host.hook.rlpost_before_run(run=runner.ctx)
            self.algos.append(state)
            self.log(f"[bench] {algo.label}: set up in {state.setup_s:.1f}s ({recipe.derived()})")

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
        record = {
            "iteration": runner.ctx.step,
            "train_time_s": state.cumulative_s,
            **{k: v for k, v in metrics.items() if k.startswith("eval/")},
        }
        state.evals.append(record)
        shown = " ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("eval/"))
        self.log(f"[bench] {state.spec.label} it {runner.ctx.step} t={state.cumulative_s:.1f}s held-out {shown}")

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
        for algo in self.algos:
            self._evaluate(algo)
        turn = 0
        status = "failed"
        try:
            while (state := self._next(turn)) is not None:
                self._step(state)
                it = state.runner.ctx.step
                rec = state.iters[-1]
                self.log(
                    f"[bench] {state.spec.label:>10} it {it:3d} {rec.wall_s:6.2f}s (total {state.cumulative_s:7.1f}s)"
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
        """Everything measured and predicted, as a JSON-ready dict."""
        assert self.calibration is not None
        calib = self.calibration
        algos: dict[str, Any] = {}
        for state in self.algos:
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
            algos[state.spec.name] = {
                "label": state.spec.label,
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
                "paper_s_per_iter": PAPER_S_PER_ITER.get(state.spec.name),
            }
        out: dict[str, Any] = {
            "machine": machine_info(),
            "spec": {
                "output_dir": self.spec.output_dir,
                "base": self.spec.base,
                "schedule": self.spec.schedule,
                "time_budget_s": self.spec.time_budget_s,
                "max_iterations": self.spec.max_iterations,
                "eval_every": self.spec.eval_every,
                "fast": self.spec.fast,
                "reference": self.spec.reference,
                "algorithms": [vars(a) for a in self.spec.algorithms],
            },
            "calibration": vars(calib),
            "peak_rss_gb_process": _peak_rss_gb(),
            "bench_wall_s": time.perf_counter() - self.started,
            "algorithms": algos,
        }
        out["comparisons"] = comparisons(out, self.spec.fast, self.spec.reference)
        return json_safe(out)  # type: ignore[no-any-return]


def _mean(values: Sequence[float]) -> float:
    return float(statistics.mean(values)) if values else math.nan


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


def _eval_value(record: dict[str, Any]) -> float | None:
    keys = sorted(k for k in record if k.startswith("eval/"))
    value = record.get(keys[0]) if keys else None
    return float(value) if isinstance(value, (int, float)) else None


def comparisons(result: dict[str, Any], fast: str | None, reference: str | None) -> dict[str, Any]:
    """Equal-iteration and equal-wall-time held-out rewards, and the speed and time-to-reward targets.

    * Equal iterations: the largest iteration at which every algorithm was evaluated and that none exceeded.
    * Equal wall time: the smallest total training time among the algorithms; each algorithm's last evaluation at or
      before it.
    """
    algos = result["algorithms"]
    out: dict[str, Any] = {}
    if not algos:
        return out
    common = set.intersection(*({int(e["iteration"]) for e in a["evals"]} for a in algos.values()))
    n_eq = max(common) if common else 0
    t_eq = min(a["train_time_s"] for a in algos.values())
    out["equal_iterations"] = {"iteration": n_eq, "heldout": {}}
    out["equal_wall_time"] = {"train_time_s": t_eq, "heldout": {}}
    for name, a in algos.items():
        at_n = [e for e in a["evals"] if int(e["iteration"]) == n_eq]
        out["equal_iterations"]["heldout"][name] = _eval_value(at_n[0]) if at_n else None
        at_t = [e for e in a["evals"] if e["train_time_s"] <= t_eq + 1e-9]
        rec = at_t[-1] if at_t else None
        out["equal_wall_time"]["heldout"][name] = (
            {"value": _eval_value(rec), "iteration": rec["iteration"], "train_time_s": rec["train_time_s"]}
            if rec
            else None
        )
        out.setdefault("before_after", {})[name] = {
            "before": _eval_value(a["evals"][0]) if a["evals"] else None,
            "after": _eval_value(a["evals"][-1]) if a["evals"] else None,
        }
    if fast is not None and reference is not None and fast in algos and reference in algos:
        f, r = algos[fast], algos[reference]
        measured = r["s_per_iter"]["median"] / f["s_per_iter"]["median"]
        predicted = r["predicted_s_per_iter"]["total_s"] / f["predicted_s_per_iter"]["total_s"]
        paper = PAPER_S_PER_ITER.get(reference, math.nan) / PAPER_S_PER_ITER.get(fast, math.nan)
        out["speed_ratio"] = {
            "fast": fast,
            "reference": reference,
            "measured": measured,
            "predicted": predicted,
            "measured_vs_predicted_rel_err": measured / predicted - 1.0,
            "paper": paper,
            "counted_rows_ratio": (r["rollout_forwards"]["counted_mean"] + r["train_forwards"]["counted_mean"])
            / max(1.0, f["rollout_forwards"]["counted_mean"] + f["train_forwards"]["counted_mean"]),
        }
        target = _eval_value(r["evals"][-1]) if r["evals"] else None
        reach = None
        if target is not None:
            hits = [e for e in f["evals"] if (_eval_value(e) or -math.inf) >= target]
            reach = hits[0] if hits else None
        # The final evaluation of a run that over-optimises can fall below its own start, which makes the "final"
        # target trivially met; the reference's best evaluation (and when it got there) is the sharper comparison.
        best_rec = max(r["evals"], key=lambda e: _eval_value(e) or -math.inf) if r["evals"] else None
        best = _eval_value(best_rec) if best_rec else None
        reach_best = None
        if best is not None:
            hits = [e for e in f["evals"] if (_eval_value(e) or -math.inf) >= best]
            reach_best = hits[0] if hits else None
        out["time_to_reference_best"] = {
            "reference_best_heldout": best,
            "reference_best_at_s": best_rec["train_time_s"] if best_rec else None,
            "reference_best_at_iteration": best_rec["iteration"] if best_rec else None,
            "fast_reached_at_s": reach_best["train_time_s"] if reach_best else None,
            "fast_reached_at_iteration": reach_best["iteration"] if reach_best else None,
            "fraction_of_reference_time_to_best": (
                reach_best["train_time_s"] / best_rec["train_time_s"]
                if reach_best and best_rec and best_rec["train_time_s"]
                else None
            ),
            "fraction_of_reference_total_time": reach_best["train_time_s"] / r["train_time_s"] if reach_best else None,
        }
        out["time_to_reference_final"] = {
            "reference_final_heldout": target,
            "reference_train_time_s": r["train_time_s"],
            "fast_reached_at_s": reach["train_time_s"] if reach else None,
            "fast_reached_at_iteration": reach["iteration"] if reach else None,
            "fraction_of_reference_time": reach["train_time_s"] / r["train_time_s"] if reach else None,
            "fast_best_heldout": max((_eval_value(e) or -math.inf) for e in f["evals"]) if f["evals"] else None,
            "target_fraction": 0.5,
        }
    return out


# ------------------------------------------------------------------------------------------------- outputs


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    """The bench tables: a Table-1-shaped summary, counts (counted vs predicted), cost model, phases, targets."""
    algos, comp, m = result["algorithms"], result.get("comparisons", {}), result["machine"]
    eq_it, eq_t = comp.get("equal_iterations", {}), comp.get("equal_wall_time", {})
    lines = [
        "# rlpost bench",
        "",
        f"Machine: {m['platform']}, {m['nproc']} CPUs (torch threads {m['torch_threads']}), torch {m['torch']}, "
        f"CUDA {'yes: ' + m.get('gpu', '') if m['cuda'] else 'no'}. Schedule {result['spec']['schedule']}, "
        f"time budget {result['spec']['time_budget_s']} s per algorithm, max {result['spec']['max_iterations']} "
        f"iterations. Bench wall time {result['bench_wall_s']:.0f} s.",
        "",
        "## Table 1 (shape of the TreeGRPO paper's)",
        "",
        f"| Method | s/iter median [IQR] | paper s/iter | iterations | held-out before | held-out after | "
        f"held-out @ it {eq_it.get('iteration')} | held-out @ {_fmt(eq_t.get('train_time_s'), '.0f')} s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in algos.items():
        s = a["s_per_iter"]
        ba = comp.get("before_after", {}).get(name, {})
        wt = (eq_t.get("heldout") or {}).get(name) or {}
        lines.append(
            f"| {a['label']} | {_fmt(s['median'], '.2f')} [{_fmt(s['q1'], '.2f')}–{_fmt(s['q3'], '.2f')}] | "
            f"{_fmt(a.get('paper_s_per_iter'), '.1f')} | {a['iterations']} | {_fmt(ba.get('before'), '.4f')} | "
            f"{_fmt(ba.get('after'), '.4f')} | {_fmt((eq_it.get('heldout') or {}).get(name), '.4f')} | "
            f"{_fmt(wt.get('value'), '.4f')} (it {wt.get('iteration', '–')}) |"
        )
    lines += [
        "",
        "## Work per iteration: counted (policy.forward_count) vs cost model (Sampler.counts)",
        "",
        "| Method | images | trainable edges | rollout fwd counted | rollout fwd predicted | train fwd+bwd counted | "
        "train fwd+bwd predicted | counts match |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for a in algos.values():
        rf, tf = a["rollout_forwards"], a["train_forwards"]
        lines.append(
            f"| {a['label']} | {_fmt(a['images_per_iter'], '.0f')} | {_fmt(a['trainable_edges_per_iter'], '.0f')} | "
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
        "| Method | rollout batch | train batch | predicted rollout s | predicted train s | "
        "predicted decode+reward s | predicted s/iter | measured median s/iter | measured / predicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in algos.values():
        p = a["predicted_s_per_iter"]
        lines.append(
            f"| {a['label']} | {_fmt(p['rollout_batch'], '.0f')} | {_fmt(p['train_batch'], '.1f')} | "
            f"{_fmt(p['rollout_forward_s'], '.2f')} | {_fmt(p['train_fwd_bwd_s'], '.2f')} | "
            f"{_fmt(p['decode_reward_s'], '.2f')} | {_fmt(p['total_s'], '.2f')} | "
            f"{_fmt(a['s_per_iter']['median'], '.2f')}"
            f" | {_fmt(a['s_per_iter']['median'] / p['total_s'] if p['total_s'] else None, '.2f')} |"
        )
    lines += [
        "",
        "## Where an iteration's time goes (mean seconds per iteration)",
        "",
        "| Method | rollout fwd | train fwd | backward | decode | reward | optimizer step | other (overhead) | "
        "overhead share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in algos.values():
        ph = a["phases_mean_s"]
        lines.append(
            f"| {a['label']} | {_fmt(ph['rollout_forward'], '.2f')} | {_fmt(ph['train_forward'], '.2f')} | "
            f"{_fmt(ph['backward'], '.2f')} | {_fmt(ph['decode'], '.3f')} | {_fmt(ph['reward'], '.3f')} | "
            f"{_fmt(ph['optimizer'], '.3f')} | {_fmt(a['overhead_s'], '.2f')} | "
            f"{_fmt(100 * a['overhead_fraction'], '.1f')} % |"
        )
    mem = [a["peak_mem_gb"] for a in algos.values() if a["peak_mem_gb"] is not None]
    lines += [""]
    if mem:
        lines.append(
            "Peak CUDA memory allocated per iteration (includes every algorithm's resident weights): "
            + ", ".join(f"{a['label']} {_fmt(a['peak_mem_gb'], '.2f')} GiB" for a in algos.values())
        )
    else:
        lines.append(
            f"Peak memory: no GPU; process peak RSS {result['peak_rss_gb_process']:.2f} GiB, **shared by all "
            "interleaved algorithms** (one process holds every model), so it is not a per-algorithm number."
        )
    sr, tr = comp.get("speed_ratio"), comp.get("time_to_reference_final")
    if sr:
        lines += [
            "",
            "## Targets",
            "",
            f"* {sr['reference']}/{sr['fast']} s/iter ratio: measured **{sr['measured']:.2f}x**, cost model "
            f"{sr['predicted']:.2f}x (measured/predicted - 1 = {100 * sr['measured_vs_predicted_rel_err']:+.1f} %; "
            f"target within 15 %), counted transformer rows {sr['counted_rows_ratio']:.2f}x, paper {sr['paper']:.2f}x.",
        ]
    if tr:
        frac = tr["fraction_of_reference_time"]
        lines.append(
            f"* {sr['fast'] if sr else 'fast'} reaching {sr['reference'] if sr else 'reference'}'s final held-out "
            f"reward {_fmt(tr['reference_final_heldout'], '.4f')} (reached after {tr['reference_train_time_s']:.0f} s):"
            + (
                f" at {tr['fast_reached_at_s']:.0f} s (iteration {tr['fast_reached_at_iteration']}), "
                f"{100 * frac:.0f} % of the reference's time (target <= 50 %)."
                if frac is not None
                else f" **not reached** (best {_fmt(tr['fast_best_heldout'], '.4f')})."
            )
        )
    tb = comp.get("time_to_reference_best")
    if tb and tb["reference_best_heldout"] is not None:
        lines.append(
            f"* {sr['fast'] if sr else 'fast'} reaching {sr['reference'] if sr else 'reference'}'s **best** held-out "
            f"reward {_fmt(tb['reference_best_heldout'], '.4f')} (first seen at {tb['reference_best_at_s']:.0f} s, "
            f"iteration {tb['reference_best_at_iteration']}):"
            + (
                f" at {tb['fast_reached_at_s']:.0f} s (iteration {tb['fast_reached_at_iteration']}), "
                f"{100 * tb['fraction_of_reference_time_to_best']:.0f} % of the reference's time to its best and "
                f"{100 * tb['fraction_of_reference_total_time']:.0f} % of its total time."
                if tb["fast_reached_at_s"] is not None and tb["fraction_of_reference_time_to_best"] is not None
                else " **not reached**."
            )
        )
    over = [a["overhead_fraction"] for a in algos.values() if a["overhead_fraction"] is not None]
    if over:
        lines.append(
            "* Time outside transformer forward/backward, VAE decode and reward scoring: "
            + ", ".join(f"{a['label']} {_fmt(100 * a['overhead_fraction'], '.1f')} %" for a in algos.values())
            + " of an iteration (target <= 10 %; the optimizer step counts as overhead)."
        )
    return "\n".join(lines) + "\n"


def plot_wallclock(result: dict[str, Any], out: Path) -> Path | None:
    """Held-out reward against accumulated training time, one line per algorithm (matplotlib, Agg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("rlpost bench: matplotlib is not installed; skipping the plot", UserWarning, stacklevel=2)
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=110)
    try:
        for i, a in enumerate(result["algorithms"].values()):
            pts = [(float(e["train_time_s"]), v) for e in a["evals"] if (v := _eval_value(e)) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=a["label"])
        ax.set_xlabel("accumulated training time (s, evaluations excluded)")
        ax.set_ylabel("held-out reward")
        ax.set_title("rlpost bench: held-out reward vs wall clock")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def write_outputs(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and ``reward_vs_wallclock.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
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
        result = json.loads((out / "bench.json").read_text())
        result["comparisons"] = json_safe(
            comparisons(result, result.get("spec", {}).get("fast"), result.get("spec", {}).get("reference"))
        )
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
