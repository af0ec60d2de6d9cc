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

Every (algorithm, seed) gets its own :class:`rlpost.engine.runner.Runner` (own policy, LoRA, optimizer, run directory);
the bench drives each through ``Runner.begin()`` / ``step()`` / ``finish(status)`` itself. With ``least-time`` it
always advances the runner with the least accumulated training time, so every algorithm and seed runs in the same
stretches of wall clock and background load hits all alike. Held-out evaluations happen between steps and are
excluded from the training time.

Measured per iteration: wall time, the runner's step phases (``runner.phases``: rollout, reward, advantage,
update; the rest is overhead), transformer rows counted through the policy's ``forward_count`` before/after the
rollout and the update, and peak memory. Predicted: the same counts from the sampler's closed forms
(``Sampler.step_counts``: TreeGRPO's rollout at the window start its ``begin_step`` drew), and seconds per iteration
from a cost model calibrated on this machine (per-row forward and forward+backward cost at the relevant batch sizes,
decode+reward per image).

Across seeds (:mod:`rlpost.bench.stats`): mean, percentile bootstrap interval and min–max of s/iter, of every
held-out ``eval/...`` metric at equal iterations and at equal wall time, of the time to reach the reference's reward
level, and of the reference/fast ratios. A difference is stated only where the intervals separate.

Outputs (in ``bench.output_dir``): ``bench.json`` (every run and the aggregates), ``bench.md`` (a table shaped like
the TreeGRPO paper's Table 1, held-out tables, ratios, reward levels, conclusions, cost model and phases),
``reward_vs_wallclock.png``, and each run's directory with its own ``bench_run.json``.

Modules: :mod:`~rlpost.bench.spec` (the recipe; its ``paper`` section: :mod:`~rlpost.bench.paper`),
:mod:`~rlpost.bench.driver` (runners and schedule),
:mod:`~rlpost.bench.measure` (per-run records), :mod:`~rlpost.bench.costmodel` (calibration and predictions),
:mod:`~rlpost.bench.aggregate`, :mod:`~rlpost.bench.compare` and :mod:`~rlpost.bench.field` (over seeds,
:mod:`~rlpost.bench.stats`), :mod:`~rlpost.bench.report`, :mod:`~rlpost.bench.tables`,
:mod:`~rlpost.bench.field_tables` and :mod:`~rlpost.bench.plot` (outputs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlpost.bench.aggregate import aggregate, eval_keys, eval_metrics, primary_metric, upgrade_legacy
from rlpost.bench.compare import comparisons
from rlpost.bench.costmodel import Calibration, calibrate, nominal_batches, predict_seconds, predicted_counts
from rlpost.bench.driver import Bench
from rlpost.bench.field import alarm_verdicts, field_comparisons
from rlpost.bench.measure import PHASES, AlgoState, IterRecord, machine_info, run_key
from rlpost.bench.plot import plot_wallclock
from rlpost.bench.report import markdown, write_outputs
from rlpost.bench.spec import PAPER_QUANTITIES, AlgoSpec, BenchSpec, load_bench
from rlpost.core.user_files import UserFileError, read_json_file
from rlpost.engine.rundir import json_safe

__all__ = [
    "PAPER_QUANTITIES",
    "PHASES",
    "AlgoSpec",
    "AlgoState",
    "Bench",
    "BenchSpec",
    "Calibration",
    "IterRecord",
    "aggregate",
    "alarm_verdicts",
    "calibrate",
    "comparisons",
    "eval_keys",
    "eval_metrics",
    "field_comparisons",
    "load_bench",
    "machine_info",
    "main",
    "markdown",
    "nominal_batches",
    "plot_wallclock",
    "predict_seconds",
    "predicted_counts",
    "primary_metric",
    "run_key",
    "upgrade_legacy",
    "write_outputs",
]

MAX_RESULT_BYTES = 256 * 1024 * 1024
"""The largest ``bench.json`` ``--report-only`` reads (a long bench over many seeds writes tens of MB)."""


def main(argv: Sequence[str]) -> int:
    """``rlpost bench --recipe BENCH.yaml [--out DIR] [--bench.KEY VALUE ...]``."""
    description = __doc__.split("\n\n")[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="rlpost bench", description=description)
    parser.add_argument("--recipe", help="bench recipe (e.g. recipes/bench/digits.yaml)")
    parser.add_argument("--out", default=None, help="output directory (default: bench.output_dir)")
    parser.add_argument(
        "--report-only",
        metavar="DIR",
        help="re-render DIR/bench.md and the plot from DIR/bench.json (no training); with --recipe, the recipe's "
        "report settings (bench.levels, bench.claims, paper) replace the recorded ones",
    )
    ns, rest = parser.parse_known_args(list(argv))
    if ns.report_only:
        out = Path(ns.report_only)
        try:
            result = read_json_file(out / "bench.json", "bench result", MAX_RESULT_BYTES)
        except UserFileError as exc:
            parser.error(f"--report-only: {exc}")
        if not isinstance(result, dict):
            parser.error(f"--report-only: {out / 'bench.json'}: not a bench result (a JSON object) of rlpost bench")
        result = upgrade_legacy(result)
        if ns.recipe:
            _refresh_report_settings(result, load_bench(ns.recipe), parser)
        alarm_verdicts(result, out)
        result["algorithms"] = json_safe(aggregate(result))
        result["comparisons"] = json_safe(comparisons(result))
        result["field"] = json_safe(field_comparisons(result))
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
    from rlpost.apps.progress import PhaseDisplay

    bench = Bench(spec)
    display = PhaseDisplay(prefix="[bench] ")
    bench.phases.listeners.append(display)  # set-up, calibration, training, evaluations, report: a spinner each
    try:
        result = bench.run()
    finally:
        display.close()
    out = Path(spec.output_dir)
    print(markdown(result))
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'} and {out / 'reward_vs_wallclock.png'}", file=sys.stderr)
    return 0


def _refresh_report_settings(result: dict[str, Any], spec: BenchSpec, parser: argparse.ArgumentParser) -> None:
    """Replace a recorded result's report settings with a bench recipe's (the same algorithms, or an error)."""
    recorded = sorted(a["name"] for a in result.get("spec", {}).get("algorithms", []))
    if recorded != sorted(a.name for a in spec.algorithms):
        mine = sorted(a.name for a in spec.algorithms)
        parser.error(f"--recipe: its algorithms {mine} are not the result's {recorded}")
    result["spec"].update(paper=spec.paper, levels=spec.levels, claims=spec.claims)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
