"""The bench driver: one :class:`rlpost.engine.runner.Runner` per (algorithm, seed), stepped in an interleaved schedule.

Every run goes through the runner's public life cycle: :meth:`~rlpost.engine.runner.Runner.begin`, then
:meth:`~rlpost.engine.runner.Runner.step` and :meth:`~rlpost.engine.runner.Runner.evaluate` as the schedule decides,
then :meth:`~rlpost.engine.runner.Runner.finish` with the bench's status. What is measured comes from declared
interfaces only: the runner's phase timer (``runner.phases``), the policy's ``forward_count`` (read at the end of the
rollout through the ``rlpost_after_rollout`` hook) and the sampler's closed-form counts (:mod:`rlpost.bench.costmodel`).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlpost.apps.host import get_host
from rlpost.bench.aggregate import aggregate, eval_metrics
from rlpost.bench.compare import comparisons
from rlpost.bench.costmodel import Calibration, calibrate, predicted_counts
from rlpost.bench.field import alarm_verdicts, field_comparisons
from rlpost.bench.measure import PHASES, AlgoState, IterRecord, bench_result, run_key
from rlpost.bench.report import write_outputs
from rlpost.bench.spec import AlgoSpec, BenchSpec
from rlpost.core.context import RunContext, RunStatus
from rlpost.core.contract import Rollout
from rlpost.core.hookspecs import hookimpl
from rlpost.core.plugins import PluginHost
from rlpost.engine.lr_schedule import bind_time_budget
from rlpost.engine.phases import PhaseTimer
from rlpost.engine.recipe import Recipe, RecipeError, RunConfig, command_line_value, parse_recipe, validate
from rlpost.engine.rundir import json_safe
from rlpost.engine.runner import Runner

__all__ = ["Bench", "ForwardProbe"]

PROBE = "rlpost.bench.probe"


class ForwardProbe:
    """Lifecycle plugin: the policy's ``forward_count`` at the end of each run's rollout, keyed by run context."""

    def __init__(self) -> None:
        self.after_rollout: dict[int, int] = {}

    @hookimpl
    def rlpost_after_rollout(self, run: RunContext, rollout: Rollout) -> None:
        """Record the count the rollout ended at (the update's forwards are counted from here)."""
        self.after_rollout[id(run)] = run.recipe.model.forward_count


class Bench:
    """Builds one runner per algorithm and seed, calibrates, interleaves their steps, evaluates and reports.

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
        self.probe = ForwardProbe()
        self.started = 0.0
        self.phases = PhaseTimer()
        """The bench's own phases: ``set-up``, ``calibration``, ``training`` (with an ``eval`` per held-out evaluation)
        and ``report``; ``rlpost bench`` shows them through its listeners (:mod:`rlpost.apps.progress`)."""

    # ----------------------------------------------------------------------------------------------- set-up
    def _runs(self) -> list[tuple[AlgoSpec, int | None]]:
        """(algorithm, seed) pairs in set-up order: seed-major, so schedule ties alternate between algorithms."""
        seeds: list[int | None] = list(self.spec.seeds) if self.spec.seeds is not None else [None]
        return [(algo, seed) for seed in seeds for algo in self.spec.algorithms]

    def _recipe(self, algo: AlgoSpec, seed: int | None) -> Recipe:
        """The validated recipe of one run: base, overlays, overrides, the seed and the bench's own settings."""
        overrides = {**self.spec.overrides, **algo.overrides}
        pairs = [(k, command_line_value(v)) for k, v in overrides.items()]
        if seed is not None:
            pairs.append(("run.seed", str(seed)))
        pairs.append(("run.progress", "false"))
        cfg = parse_recipe([*self.spec.base, *algo.recipes], pairs, self.host)  # as rlpost train parses them
        # Evaluation is driven by the bench between steps (untimed); the runner must not evaluate itself.
        if isinstance(cfg.get("eval"), dict):
            cfg["eval"]["every"] = 0
        # A schedule over the run's time (lr_scheduler: rlpost.RunLengthLR, over: time) ends with the bench's budget.
        if self.spec.time_budget_s is not None and "lr_scheduler" in cfg:
            cfg["lr_scheduler"] = bind_time_budget(cfg["lr_scheduler"], self.spec.time_budget_s)
        # So does a sampler schedule over time (init_args shift_over: time, e.g. MixGRPO's window over the run).
        sampler_args = (cfg.get("sampler") or {}).get("init_args") if isinstance(cfg.get("sampler"), dict) else None
        if self.spec.time_budget_s is not None and isinstance(sampler_args, dict):
            if sampler_args.get("shift_over") == "time" and sampler_args.get("budget_s") is None:
                sampler_args["budget_s"] = self.spec.time_budget_s
        # The run directory names the seed the run really uses (the recipe's own when bench.seeds is unset).
        run_cfg = cfg.setdefault("run", {})
        if isinstance(run_cfg, dict):
            run_cfg["output_dir"] = str(self.out / run_key(algo.name, run_cfg.get("seed", RunConfig.seed)))
        return validate(cfg, self.host)

    def build(self) -> None:
        """Validate every (algorithm, seed) recipe (all problems at once), then begin the runners.

        A seed of ``None`` (no ``bench.seeds``) keeps the recipe's own ``run.seed``.
        """
        taken = [self.out / a.name for a in self.spec.algorithms] + [self.out / "bench.json"]
        if any(p.exists() for p in taken):
            raise FileExistsError(f"bench output directory {self.out} already holds a bench; choose another --out")
        problems: list[str] = []
        planned: list[tuple[AlgoSpec, Recipe]] = []
        for algo, seed in self._runs():
            try:
                planned.append((algo, self._recipe(algo, seed)))
            except RecipeError as exc:
                # Seeds share an algorithm's recipe, so its problems are listed once.
                problems += [m for p in exc.problems if (m := f"{algo.name}: {p}") not in problems]
        if problems:
            raise RecipeError(problems)
        self.out.mkdir(parents=True, exist_ok=True)
        self.host.register_plugin(self.probe, name=PROBE)
        for algo, recipe in planned:
            t0 = time.perf_counter()
            runner = Runner(recipe, self.host)
            runner.phases.sync_cuda = runner.device.type == "cuda"  # charge kernels to the phase that launched them
            runner.begin()
            state = AlgoState(algo, recipe, runner, runner.phases, seed=recipe.run.seed)
            state.setup_s = time.perf_counter() - t0
            self.algos.append(state)
            self.log(f"[bench] {state.tag}: set up in {state.setup_s:.1f}s ({recipe.derived()})")

    # -------------------------------------------------------------------------------------------- stepping
    def _evaluate(self, state: AlgoState) -> None:
        runner = state.runner
        with self.phases.timed("eval"):
            metrics = runner.evaluate()
        record = {"iteration": runner.ctx.step, "train_time_s": state.cumulative_s, **eval_metrics(metrics)}
        state.evals.append(record)
        shown = " ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("eval/"))
        self.log(f"[bench] {state.tag} it {runner.ctx.step} t={state.cumulative_s:.1f}s held-out {shown}")

    def _step(self, state: AlgoState) -> IterRecord:
        runner, policy = state.runner, state.recipe.model
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        before = policy.forward_count
        t0 = time.perf_counter()
        metrics = runner.step()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        pred = predicted_counts(state.recipe)  # after the step: the counts of the draws its begin_step made
        mid = self.probe.after_rollout.get(id(runner.ctx), before)
        update = runner.last_update.result if runner.last_update is not None else None  # None: the guards skipped it
        reference = update.reference_forwards if update is not None else 0  # the update's forwards include a KL's
        state.cumulative_s += wall
        record = IterRecord(
            iteration=runner.ctx.step,
            wall_s=wall,
            cumulative_s=state.cumulative_s,
            phases={p: state.phases.current.get(p, 0.0) for p in PHASES},
            rollout_forwards=mid - before,
            train_forwards=policy.forward_count - mid - reference,
            reference_forwards=reference,
            predicted=pred,
            images=int(metrics.get("perf/images", 0)),
            trainable_edges=update.trained_edges if update is not None else 0,
            reward=float(metrics.get("reward/weighted", math.nan)),
            peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        )
        state.iters.append(record)
        return record

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

    def _schedule(self) -> None:
        """Evaluate every run, then step the next run until all are finished; evaluate each at its end."""
        for algo in self.algos:
            self._evaluate(algo)
        self._check_metric()
        turn = 0
        while (state := self._next(turn)) is not None:
            rec = self._step(state)
            it = state.runner.ctx.step
            self.log(
                f"[bench] {state.tag:>13} it {it:3d} {rec.wall_s:6.2f}s (total {state.cumulative_s:7.1f}s)"
                f" reward {rec.reward:.3f} rows {rec.rollout_forwards}+{rec.train_forwards}"
                + (f"+{rec.reference_forwards} ref" if rec.reference_forwards else "")
            )
            if self.spec.eval_every > 0 and it % self.spec.eval_every == 0 and not self._finished(state):
                self._evaluate(state)
            turn += 1
        for state in self.algos:
            if not state.evals or state.evals[-1]["iteration"] != state.runner.ctx.step:
                self._evaluate(state)

    def run(self) -> dict[str, Any]:
        """Build, calibrate, run the interleaved schedule, evaluate, write the report; returns the JSON result."""
        with self.phases.timed("set-up"):
            self.build()
        self.started = time.perf_counter()
        with self.phases.timed("calibration"):
            self.calibration = calibrate(
                self.algos[0].recipe, self.spec.calibration_batch_sizes, self.spec.calibration_repeats
            )
        self.log(f"[bench] calibration: {self.calibration}")
        status = RunStatus.FAILED
        try:
            with self.phases.timed("training"):
                self._schedule()
            status = RunStatus.COMPLETED
        except KeyboardInterrupt:
            status = RunStatus.INTERRUPTED
            raise
        finally:
            self._close(status)
        with self.phases.timed("report"):
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

    def _close(self, status: RunStatus) -> None:
        """Every run ends with an end checkpoint (the bench, not ``run.max_steps``, decided when it stops) and
        :meth:`rlpost.engine.runner.Runner.finish`."""
        self.host.unregister_plugin(PROBE)
        for state in self.algos:
            runner = state.runner
            try:
                if runner.ctx.step > 0 and state.recipe.checkpoint.at_end:
                    runner.save_checkpoint("end")
            except Exception as exc:  # noqa: BLE001 - a failed checkpoint must not lose the measurements
                warnings.warn(f"bench: checkpoint of {state.spec.name} failed: {exc}", UserWarning, stacklevel=2)
            runner.finish(status)

    def result(self) -> dict[str, Any]:
        """Everything measured and predicted, per run and aggregated over seeds, as a JSON-ready dict."""
        assert self.calibration is not None
        out = json_safe(bench_result(self.spec, self.algos, self.calibration, time.perf_counter() - self.started))
        alarm_verdicts(out)
        out["algorithms"] = aggregate(out)
        out["comparisons"] = comparisons(out)
        out["field"] = field_comparisons(out)
        return json_safe(out)  # type: ignore[no-any-return]
