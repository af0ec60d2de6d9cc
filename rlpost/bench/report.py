"""The bench report: ``bench.md`` (a table shaped like the TreeGRPO paper's Table 1, held-out tables, ratios, reward
levels, conclusions, counts, cost model and phases), ``bench.json``, the plot and each run's ``bench_run.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import rlpost.bench.stats as stats
from rlpost.bench.aggregate import numeric
from rlpost.bench.field_tables import field_tables
from rlpost.bench.plot import plot_wallclock
from rlpost.bench.tables import ci, fmt, heldout_tables, level_tables, own_best_table, ratio_table

__all__ = ["markdown", "write_outputs"]


def markdown(result: dict[str, Any]) -> str:
    """The bench report: Table-1-shaped summary, held-out tables (every ``eval/`` metric), reference/fast ratios
    next to the paper's, time to the reference's reward level, conclusions, counts, cost model, phases."""
    algos, comp, m, spec = result["algorithms"], result.get("comparisons", {}), result["machine"], result["spec"]
    paper = spec.get("paper") or {}
    eq_it, eq_t = comp.get("equal_iterations", {}), comp.get("equal_wall_time", {})
    metric = comp.get("metric")
    boot = spec.get("bootstrap") or {}
    conf = 100 * float(boot.get("confidence", stats.DEFAULT_CONFIDENCE))
    resamples = boot.get("resamples", stats.DEFAULT_RESAMPLES)
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
        f"percentile bootstrap interval of it ({resamples} resamples of the seeds, RNG seed "
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
        f"held-out @ it {eq_it.get('iteration')} | held-out @ {fmt(eq_t.get('train_time_s'), '.0f')} s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    marks: dict[str, int] = {}
    for name, a in algos.items():
        ba = (comp.get("before_after", {}).get(metric) or {}).get(name, {})
        lines.append(
            f"| {a['label']} | {a['preset']} | {ci(a['s_per_iter'], '.2f')} | "
            f"{_paper_cell(paper, 's_per_iter', name, marks)} | {', '.join(str(i) for i in a['iterations'])} | "
            f"{ci(ba.get('before'), '.4f')} | "
            f"{ci((eq_it.get('heldout', {}).get(metric) or {}).get(name), '.4f')} | "
            f"{ci((eq_t.get('heldout', {}).get(metric) or {}).get(name), '.4f')} |"
        )
    notes = [(mark, key) for key, mark in marks.items()]
    if notes or paper.get("notes"):
        lines.append("")
        for mark, key in sorted(notes):
            qty, name = key.split(":", 1)
            lines.append(f"[{mark}] {paper[qty]['notes'][name]}")
        for name, note in (paper.get("notes") or {}).items():
            lines.append(f"* {algos[name]['label'] if name in algos else name} [{name}]: {note}")
    lines += heldout_tables(algos, comp)
    lines += ratio_table(result, algos, comp)
    lines += level_tables(result, algos, comp)
    lines += own_best_table(result, algos, comp)
    lines += field_tables(result, algos)
    if comp.get("conclusions"):
        lines += ["", "## Conclusions (a direction only where the intervals separate)", ""]
        lines += [f"* {c}" for c in comp["conclusions"]]
    lines += [
        "",
        "## Work per iteration: counted (policy.forward_count) vs cost model (Sampler.step_counts), all seeds pooled",
        "",
        "| Method | preset | images | trainable edges | rollout fwd counted | rollout fwd predicted | "
        "train fwd+bwd counted | train fwd+bwd predicted | reference fwd (KL) counted | reference fwd predicted | "
        "counts match (every iteration of every seed) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for a in algos.values():
        rf, tf = a["rollout_forwards"], a["train_forwards"]
        ref = a["reference_forwards"]
        match = rf["all_equal"] and tf["all_equal"] and ref["all_equal"]
        lines.append(
            f"| {a['label']} | {a['preset']} | {fmt(a['images_per_iter'], '.0f')} | "
            f"{fmt(a['trainable_edges_per_iter'], '.0f')} | "
            f"{fmt(rf['counted_mean'], '.1f')} | {fmt(rf['predicted_mean'], '.1f')} "
            f"(E={fmt(rf['predicted_expected'], '.1f')}) | {fmt(tf['counted_mean'], '.1f')} | "
            f"{fmt(tf['predicted_mean'], '.1f')} | {fmt(ref['counted_mean'], '.1f')} | "
            f"{fmt(ref['predicted_mean'], '.1f')} | {'yes' if match else 'NO'} |"
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
        "| Method | preset | rollout batch | train batch | predicted rollout s | "
        "predicted train s (incl. reference fwd) | predicted decode+reward s | predicted s/iter | "
        "measured s/iter (mean of seeds' medians) | measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in algos.values():
        p = a["predicted_s_per_iter"]
        measured = numeric(a["s_per_iter"].get("mean"))
        lines.append(
            f"| {a['label']} | {a['preset']} | {fmt(p['rollout_batch'], '.0f')} | {fmt(p['train_batch'], '.1f')} | "
            f"{fmt(p['rollout_forward_s'], '.2f')} | {fmt(p['train_fwd_bwd_s'] + p['reference_forward_s'], '.2f')} | "
            f"{fmt(p['decode_reward_s'], '.2f')} | {fmt(p['total_s'], '.2f')} | {fmt(measured, '.2f')}"
            f" | {fmt(measured / p['total_s'] if measured is not None and p['total_s'] else None, '.2f')} |"
        )
    lines += [
        "",
        "## Where an iteration's time goes (mean seconds per iteration, seeds pooled)",
        "",
        "The runner's step phases (`runner.phases`, rlpost/engine/phases.py): rollout = transformer forwards and VAE "
        "decode "
        "of the sampler; update = training forwards, backward and optimizer steps; other = hooks, gathering, EMA "
        "and logging between them.",
        "",
        "| Method | preset | rollout | reward | advantage | update | other (overhead) | overhead share |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for a in algos.values():
        ph = a["phases_mean_s"]
        lines.append(
            f"| {a['label']} | {a['preset']} | {fmt(ph.get('rollout'), '.2f')} | {fmt(ph.get('reward'), '.3f')} | "
            f"{fmt(ph.get('advantage'), '.3f')} | {fmt(ph.get('update'), '.2f')} | {fmt(a['overhead_s'], '.2f')} | "
            f"{fmt(100 * a['overhead_fraction'] if a['overhead_fraction'] is not None else None, '.1f')} % |"
        )
    lines += _speedup_lines(algos)
    mem = [a["peak_mem_gb"] for a in algos.values() if a["peak_mem_gb"] is not None]
    lines += [""]
    if mem:
        lines.append(
            "Peak CUDA memory allocated per iteration (includes every run's resident weights): "
            + ", ".join(f"{a['label']} [{a['preset']}] {fmt(a['peak_mem_gb'], '.2f')} GiB" for a in algos.values())
        )
    else:
        lines.append(
            f"Peak memory: no GPU; process peak RSS {result['peak_rss_gb_process']:.2f} GiB, **shared by all "
            "interleaved runs** (one process holds every model), so it is not a per-algorithm number."
        )
    return "\n".join(lines) + "\n"


def _speedup_lines(algos: dict[str, Any]) -> list[str]:
    """The speed-ups of each algorithm (``run.speedups``) and the ratio guard's measurement before training; nothing
    when no algorithm turned one on."""
    if not any(a.get("speedups") for a in algos.values()):
        return []
    lines = [
        "",
        "## Speed-ups and the ratio guard (run.speedups; docs/speed.md)",
        "",
        "Before training, each run with a speed-up re-evaluated one rollout through the training path; "
        "max |ratio - 1| must stay within the tolerance or the run refuses to start. Guard time is set-up time (it "
        "includes compilation for the first shapes), outside s/iter.",
        "",
        "| Method | preset | speed-ups | guard max abs(ratio - 1) (max over seeds) | per seed | tolerance | guard s |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for a in algos.values():
        guard = a.get("ratio_guard")
        speedups = ", ".join(a.get("speedups") or []) or "none"
        if guard is None:  # no speed-up, or only overlap, which changes no ratio (docs/speed.md)
            why = "not run (changes no ratio)" if a.get("speedups") else "–"
            lines.append(f"| {a['label']} | {a['preset']} | {speedups} | {why} | – | – | – |")
            continue
        seeds = ", ".join(f"{v:.2g}" for v in guard["per_seed"])
        lines.append(
            f"| {a['label']} | {a['preset']} | {speedups} | {guard['max_error']:.2g} | {seeds} | "
            f"{guard['tolerance']:g} | {fmt(guard['seconds_mean'], '.1f')} |"
        )
    return lines


def _paper_cell(paper: dict[str, Any], qty: str, name: str, marks: dict[str, int]) -> str:
    section = paper.get(qty) or {}
    value = numeric((section.get("values") or {}).get(name))
    if value is None:
        return "–"
    note = (section.get("notes") or {}).get(name)
    if not note:
        return f"{value:.1f}"
    mark = marks.setdefault(f"{qty}:{name}", len(marks) + 1)
    return f"{value:.1f} [{mark}]"


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
