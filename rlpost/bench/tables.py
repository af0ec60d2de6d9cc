"""The sections of the bench report that compare algorithms (held-out metrics, ratios, time to a reward level), and
the number formats every table of it uses."""

from __future__ import annotations

import math
from typing import Any

import rlpost.bench.stats as stats
from rlpost.bench.aggregate import numeric

__all__ = ["ci", "fmt", "heldout_tables", "level_tables", "own_best_table", "ratio_table"]


def fmt(value: Any, spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``; ``–`` when absent or not finite."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def ci(summary: dict[str, Any] | None, spec: str = ".3f") -> str:
    """``mean [lo–hi] (min–max, n=N)`` of a :func:`rlpost.bench.stats.summarize` result; a bare value for n=1."""
    if not summary or not summary.get("n"):
        return "–"
    mean = fmt(summary["mean"], spec)
    if summary["n"] == 1:
        return f"{mean} (n=1)"
    if summary["min"] == summary["max"]:
        return f"{mean} (n={summary['n']}, all equal)"
    return (
        f"{mean} [{fmt(summary['lo'], spec)}–{fmt(summary['hi'], spec)}] "
        f"({fmt(summary['min'], spec)}–{fmt(summary['max'], spec)}, n={summary['n']})"
    )


def _ratio(summary: dict[str, Any] | None) -> str:
    if not summary or numeric(summary.get("mean")) is None:
        return "–"
    body = f"{summary['mean']:.2f}x"
    if numeric(summary.get("lo")) is not None and summary["lo"] != summary["hi"]:
        body += f" [{summary['lo']:.2f}–{summary['hi']:.2f}] ({summary['min']:.2f}–{summary['max']:.2f})"
    return body


def _times(value: Any) -> str:
    """A ratio as ``2.41x`` (``–`` when absent)."""
    return "–" if numeric(value) is None else f"{value:.2f}x"


def _vs(summary: dict[str, Any] | None, point: float | None) -> str:
    """Whether an interval excludes ``point``, with the side it lies on when it does."""
    if not summary or point is None or numeric(summary.get("mean")) is None:
        return "–"
    if stats.verdict(summary, (point, point)) != "separated":
        return f"includes {point:.2f}"
    return f"excludes {point:.2f} ({'above' if summary['mean'] > point else 'below'})"


def heldout_tables(algos: dict[str, Any], comp: dict[str, Any]) -> list[str]:
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
            f"@ {fmt(eq_t.get('train_time_s'), '.0f')} s | iteration of the @ "
            f"{fmt(eq_t.get('train_time_s'), '.0f')} s value, per seed |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for name, a in algos.items():
            its = eq_t.get("iterations", {}).get(name) or []
            lines.append(
                f"| {a['label']} | {a['preset']} | {ci(ba[name]['before'], '.4f')} | "
                f"{ci(ba[name]['after'], '.4f')} | "
                f"{ci(ba[name]['best'], '.4f')} | {ci(eq_it['heldout'][key].get(name), '.4f')} | "
                f"{ci(eq_t['heldout'][key].get(name), '.4f')} | {', '.join(fmt(i, 'd') for i in its)} |"
            )
        lines.append("")
    return lines


def ratio_table(result: dict[str, Any], algos: dict[str, Any], comp: dict[str, Any]) -> list[str]:
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


def level_tables(result: dict[str, Any], algos: dict[str, Any], comp: dict[str, Any]) -> list[str]:
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
            f"({', '.join(fmt(v, '.4f') for v in lv['reference_per_seed'])}), so every seed of it reaches the "
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
            lines.append(f"| {algos[name]['label']} | {algos[name]['preset']} | {_reach_cells(t)} |")
    return lines


def _reach_cells(t: dict[str, Any]) -> str:
    """``reached | time (s) | iteration per seed`` cells of one algorithm's time to a level."""
    reached = f"{t['reached']}/{t['n']}" + ("" if t["reached"] == t["n"] else " (**not reached** by all)")
    iterations = ", ".join("not reached" if i is None else str(i) for i in t["iterations"])
    return f"{reached} | {ci(t['time_s'], '.1f')} | {iterations}"


def own_best_table(result: dict[str, Any], algos: dict[str, Any], comp: dict[str, Any]) -> list[str]:
    """The stricter time-to-reward reading (``comparisons()["own_best"]``): time to the reference's mean best level
    against the time the reference took to reach its own best, per fast algorithm."""
    ob = comp.get("own_best")
    if not ob or not ob["by_algorithm"]:
        return []
    ref = result["spec"].get("reference")
    lines = [
        "",
        f"## Time to {algos[ref]['label']}'s mean best level, against its own time to its best: "
        f"`{ob['metric']}` >= {ob['level']:.4f}",
        "",
        f"The level is the mean of {algos[ref]['label']}'s per-seed best values "
        f"({', '.join(fmt(v, '.4f') for v in ob['reference_per_seed'])}); {algos[ref]['label']}'s time is each "
        f"seed's training time at its own best evaluation ({', '.join(fmt(v, '.1f') for v in ob['reference_times_s'])}"
        f" s: {ci(ob['reference_time_s'], '.1f')}). Ratio = {algos[ref]['label']}'s mean time / the algorithm's mean "
        "time to the level (> 1 favours the algorithm; only when all its seeds reach the level).",
        "",
        "| Method | preset | reached | time (s) | iteration per seed | ratio | vs 1 |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for name, t in ob["by_algorithm"].items():
        r = ob["ratios"][name]
        ratio = "not computed | –" if "not_reached" in r else f"{_ratio(r)} | {_vs(r, 1.0)}"
        lines.append(f"| {algos[name]['label']} | {algos[name]['preset']} | {_reach_cells(t)} | {ratio} |")
    return lines
