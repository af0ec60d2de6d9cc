"""Comparisons between algorithms over seeds: held-out metrics at equal iterations and equal wall time, the
reference's reward levels and the time to reach them, reference/fast ratios, and the conclusions the intervals
allow (:func:`rlpost.bench.stats.compare`)."""

from __future__ import annotations

from typing import Any

import rlpost.bench.stats as stats
from rlpost.bench.aggregate import (
    aggregate,
    eval_keys,
    numeric,
    paper_value,
    primary_metric,
    runs_by_algorithm,
    stats_kwargs,
)
from rlpost.bench.spec import PAPER_QUANTITIES, as_names

__all__ = ["best_value", "comparisons", "final_value", "own_best"]


def _at_iteration(run: dict[str, Any], key: str, iteration: int) -> float | None:
    hits = [e for e in run["evals"] if int(e["iteration"]) == iteration]
    return numeric(hits[0].get(key)) if hits else None


def _at_time(run: dict[str, Any], t: float) -> dict[str, Any] | None:
    """The run's last evaluation at or before training time ``t``."""
    hits = [e for e in run["evals"] if float(e["train_time_s"]) <= t + 1e-9]
    return hits[-1] if hits else None


def best_value(run: dict[str, Any], key: str) -> float | None:
    """The run's highest evaluation of ``key`` (``None``: never evaluated)."""
    values = [v for e in run["evals"] if (v := numeric(e.get(key))) is not None]
    return max(values) if values else None


def _first(run: dict[str, Any], key: str) -> float | None:
    return numeric(run["evals"][0].get(key)) if run["evals"] else None


def final_value(run: dict[str, Any], key: str) -> float | None:
    """The run's last evaluation of ``key`` (``None``: never evaluated)."""
    values = [v for e in run["evals"] if (v := numeric(e.get(key))) is not None]
    return values[-1] if values else None


def _time_to(runs: list[dict[str, Any]], key: str, level: float, kw: dict[str, Any]) -> dict[str, Any]:
    hits = [stats.first_reach(r["evals"], key, level) for r in runs]
    times = [float(h["train_time_s"]) if h else None for h in hits]
    return {
        "n": len(runs),
        "reached": sum(h is not None for h in hits),
        "times_s": times,
        "iterations": [int(h["iteration"]) if h else None for h in hits],
        # Over the seeds that reached the level; the report flags any seed that did not.
        "time_s": stats.summarize(times, **kw),
    }


def own_best(
    by_algo: dict[str, list[dict[str, Any]]], reference: str, fast: list[str], key: str, kw: dict[str, Any]
) -> dict[str, Any] | None:
    """The stricter time-to-reward reading: the reference's *mean* best and the time it took to get there.

    Level = the mean over the reference's seeds of each seed's best value (not every reference seed reaches it);
    the reference's time = each seed's training time at its own best evaluation (the first, on ties); a fast
    algorithm's time = its first evaluation at or above the level. Ratio = mean reference time / mean fast time, only
    when every seed of the fast algorithm reached the level.
    """
    ref_runs = by_algo[reference]
    found = [best_value(r, key) for r in ref_runs]
    bests = [b for b in found if b is not None]
    if len(bests) < len(found):
        return None
    level = sum(bests) / len(bests)
    ref_times = [_time_to([run], key, b, kw)["times_s"][0] for run, b in zip(ref_runs, bests, strict=True)]
    out: dict[str, Any] = {
        "metric": key,
        "level": level,
        "reference_per_seed": bests,
        "reference_times_s": ref_times,
        "reference_time_s": stats.summarize(ref_times, **kw),
        "by_algorithm": {},
        "ratios": {},
    }
    for f in fast:
        if f not in by_algo:
            continue
        t = _time_to(by_algo[f], key, level, kw)
        out["by_algorithm"][f] = t
        out["ratios"][f] = _time_ratio(ref_times, t, f"{f} {t['reached']}/{t['n']} seeds", kw)
    return out


def _time_ratio(
    ref_times: list[float | None], fast: dict[str, Any], missing: str, kw: dict[str, Any]
) -> dict[str, Any]:
    """Reference / fast mean time with its interval and verdict against 1, or ``{"not_reached": missing}`` when a
    seed of either side has no time."""
    if None in ref_times or fast["reached"] < fast["n"]:
        return {"not_reached": missing}
    ratio = stats.ratio_summary(ref_times, fast["times_s"], **kw)
    ratio["vs_1"] = stats.verdict(ratio, (1.0, 1.0))
    return ratio


def _counted_rows(algo: dict[str, Any]) -> float:
    """Transformer rows per iteration: rollout forwards, training forward+backward rows and a KL term's reference
    forwards."""
    return float(sum(algo[k]["counted_mean"] for k in ("rollout_forwards", "train_forwards", "reference_forwards")))


def comparisons(result: dict[str, Any]) -> dict[str, Any]:
    """Held-out metrics at equal iterations and equal wall time, reward levels, ratios and the stated conclusions.

    * Equal iterations: the largest iteration at which every run was evaluated.
    * Equal wall time: the smallest total training time among the runs; each run's last evaluation at or before it.
    * Reward levels (on :func:`primary_metric`): ``best`` = the lowest of the reference's per-seed best values,
      ``final`` = the lowest of its per-seed final values, so every reference seed reaches both; each run's time to
      its first evaluation at or above the level (``None``: not reached). ``own_best``: the stricter reading
      of :func:`own_best` (the reference's mean best, against the time the reference took to reach its own best).
    * Ratios, for every fast algorithm: reference / fast for s/iter and for time to each level (bootstrap over the
      seeds of both; a time ratio only when every seed of both reached the level), the cost model's and the counted
      rows' ratios, and the paper's.
    * Conclusions: one sentence per quantity and algorithm against the reference; a direction only where the
      intervals separate (:func:`rlpost.bench.stats.compare`).
    """
    by_algo = runs_by_algorithm(result)
    algos = result.get("algorithms") or aggregate(result)
    spec = result.get("spec", {})
    kw = stats_kwargs(result)
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
            eq_it[name] = stats.summarize([_at_iteration(r, key, n_eq) for r in runs], **kw)
            recs = [_at_time(r, t_eq) for r in runs]
            eq_t[name] = stats.summarize([numeric(x.get(key)) if x else None for x in recs], **kw)
            out["equal_wall_time"]["iterations"][name] = [int(x["iteration"]) if x else None for x in recs]
            ba[name] = {
                "before": stats.summarize(
                    [numeric(r["evals"][0].get(key)) if r["evals"] else None for r in runs], **kw
                ),
                "after": stats.summarize([final_value(r, key) for r in runs], **kw),
                "best": stats.summarize([best_value(r, key) for r in runs], **kw),
            }
        out["equal_iterations"]["heldout"][key] = eq_it
        out["equal_wall_time"]["heldout"][key] = eq_t
        out["before_after"][key] = ba
    reference = spec.get("reference")
    fast = as_names(spec.get("fast"))
    if metric is not None and reference in by_algo:
        ref_runs = by_algo[reference]
        levels: dict[str, Any] = {}
        for level_name, per_seed in (
            ("best", [best_value(r, metric) for r in ref_runs]),
            ("final", [final_value(r, metric) for r in ref_runs]),
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
        out["own_best"] = own_best(by_algo, reference, fast, metric, kw)
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
                "s_per_iter": stats.ratio_summary(ref_med, [r["s_per_iter"]["median"] for r in by_algo[f]], **kw),
            }
            pred_f, pred_r = fa["predicted_s_per_iter"]["total_s"], ra["predicted_s_per_iter"]["total_s"]
            entry["cost_model"] = pred_r / pred_f if pred_f and pred_r else None
            entry["measured_vs_predicted_rel_err"] = (
                entry["s_per_iter"]["mean"] / entry["cost_model"] - 1.0
                if entry["cost_model"] and numeric(entry["s_per_iter"]["mean"]) is not None
                else None
            )
            rows_f, rows_r = _counted_rows(fa), _counted_rows(ra)
            entry["counted_rows"] = rows_r / rows_f if rows_f else None
            entry["s_per_iter_vs_1"] = stats.verdict(entry["s_per_iter"], (1.0, 1.0))
            for qty in PAPER_QUANTITIES:
                p_f, p_r = paper_value(result, qty, f), paper_value(result, qty, reference)
                paper = p_r / p_f if p_f and p_r else None
                entry[f"paper_{qty}"] = paper
            paper_s = entry["paper_s_per_iter"]
            entry["s_per_iter_vs_paper"] = (
                stats.verdict(entry["s_per_iter"], (paper_s, paper_s)) if paper_s is not None else None
            )
            entry["time_to_level"] = {}
            for level_name, lv in out.get("levels", {}).items():
                tf, tr = lv["by_algorithm"][f], lv["by_algorithm"][reference]
                missing = f"{f} {tf['reached']}/{tf['n']} seeds, {reference} {tr['reached']}/{tr['n']}"
                entry["time_to_level"][level_name] = _time_ratio(tr["times_s"], tf, missing, kw)
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
            stats.compare(
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
                stats.compare(
                    me,
                    eq_it[name],
                    ref,
                    eq_it[reference],
                    quantity=f"{key} at iteration {comp['equal_iterations']['iteration']}",
                )
            )
            lines.append(
                stats.compare(
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
                    stats.compare(
                        me, mine["time_s"], ref, theirs["time_s"], quantity=quantity, higher="slower", lower="faster"
                    )
                )
    return lines
