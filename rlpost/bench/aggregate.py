"""Aggregation over training seeds: every (algorithm, seed) run of ``bench.json`` grouped per algorithm and
summarised (s/iter over per-seed medians with a bootstrap interval; counts, phases and the cost model pooled over
seeds, which run the same recipe)."""

from __future__ import annotations

from typing import Any

import rlpost.bench.stats as stats
from rlpost.bench.measure import PHASES, mean, median_iqr, run_key

__all__ = [
    "aggregate",
    "eval_keys",
    "eval_metrics",
    "numeric",
    "paper_value",
    "primary_metric",
    "runs_by_algorithm",
    "stats_kwargs",
    "upgrade_legacy",
]


def eval_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric ``eval/...`` entries of an evaluator's result, whatever sets and judges it reports."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k.startswith("eval/") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def numeric(value: Any) -> float | None:
    """A real number as ``float``; ``None`` for anything else (booleans included)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def upgrade_legacy(result: dict[str, Any]) -> dict[str, Any]:
    """An older ``bench.json`` in the current shape, so ``--report-only`` can re-render it.

    * Written before seeds existed (``algorithms`` holding single runs, no ``runs``): one run per algorithm with the
      recipe's seed (recorded as 0).
    * Written before a KL term's reference forwards were counted apart: they are inside the training rows there, so
      the runs record no reference forwards and no predicted reference time.
    """
    if "runs" not in result:
        algos = result.get("algorithms", {})
        result["runs"] = {run_key(n, 0): {**a, "algorithm": n, "seed": 0} for n, a in algos.items()}
        spec = result.setdefault("spec", {})
        spec.setdefault("algorithms", [{"name": n, "label": a.get("label", n)} for n, a in algos.items()])
    for run in result["runs"].values():
        run.setdefault("reference_forwards", {"counted_mean": 0.0, "predicted_mean": 0.0, "all_equal": True})
        run.setdefault("predicted_s_per_iter", {}).setdefault("reference_forward_s", 0.0)
    return result


def runs_by_algorithm(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
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
        for runs in runs_by_algorithm(result).values()
        for run in runs
        for e in run["evals"]
        for k, v in e.items()
        if k.startswith("eval/") and numeric(v) is not None
    }
    return sorted(keys)


def primary_metric(result: dict[str, Any]) -> str | None:
    """The held-out metric reward levels are defined on: ``bench.metric``, else ``eval/<first training reward>``
    when the evaluator reports it, else the first key in sorted order."""
    keys = eval_keys(result)
    chosen = result.get("spec", {}).get("metric")
    if chosen:
        return str(chosen) if chosen in keys else None
    for runs in runs_by_algorithm(result).values():
        for name in runs[0].get("train_rewards", []):
            if f"eval/{name}" in keys:
                return f"eval/{name}"
    return keys[0] if keys else None


def stats_kwargs(result: dict[str, Any]) -> dict[str, Any]:
    """The recipe's bootstrap settings as keyword arguments of :mod:`rlpost.bench.stats`."""
    boot = result.get("spec", {}).get("bootstrap") or {}
    return {
        "resamples": int(boot.get("resamples", stats.DEFAULT_RESAMPLES)),
        "confidence": float(boot.get("confidence", stats.DEFAULT_CONFIDENCE)),
        "seed": int(boot.get("seed", 0)),
    }


def paper_value(result: dict[str, Any], quantity: str, name: str) -> float | None:
    """The paper's ``quantity`` for algorithm ``name`` from the recipe's ``paper`` section, if it gives one."""
    section = (result.get("spec", {}).get("paper") or {}).get(quantity) or {}
    return numeric((section.get("values") or {}).get(name))


def aggregate(result: dict[str, Any]) -> dict[str, Any]:
    """Per algorithm: its seeds' runs summarised (s/iter over per-seed medians with a bootstrap interval; counts,
    phases and the cost model pooled over seeds, which run the same recipe)."""
    kw = stats_kwargs(result)
    out: dict[str, Any] = {}
    for name, runs in runs_by_algorithm(result).items():
        first = runs[0]
        pooled_walls = [float(it["wall_s"]) for r in runs for it in r.get("iters", [])]
        med, q1, q3 = median_iqr(pooled_walls)
        pred_keys = (
            "rollout_forward_s",
            "train_fwd_bwd_s",
            "reference_forward_s",
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
            "s_per_iter": stats.summarize([r["s_per_iter"]["median"] for r in runs], **kw),
            "s_per_iter_pooled": {"median": med, "q1": q1, "q3": q3},
            "images_per_iter": mean([r["images_per_iter"] for r in runs]),
            "trainable_edges_per_iter": mean([r["trainable_edges_per_iter"] for r in runs]),
            "rollout_forwards": {
                "counted_mean": mean([r["rollout_forwards"]["counted_mean"] for r in runs]),
                "predicted_mean": mean([r["rollout_forwards"]["predicted_mean"] for r in runs]),
                "predicted_expected": mean([r["rollout_forwards"]["predicted_expected"] for r in runs]),
                "all_equal": all(r["rollout_forwards"]["all_equal"] for r in runs),
            },
            "train_forwards": {
                "counted_mean": mean([r["train_forwards"]["counted_mean"] for r in runs]),
                "predicted_mean": mean([r["train_forwards"]["predicted_mean"] for r in runs]),
                "all_equal": all(r["train_forwards"]["all_equal"] for r in runs),
            },
            "reference_forwards": {
                "counted_mean": mean([r["reference_forwards"]["counted_mean"] for r in runs]),
                "predicted_mean": mean([r["reference_forwards"]["predicted_mean"] for r in runs]),
                "all_equal": all(r["reference_forwards"]["all_equal"] for r in runs),
            },
            "phases_mean_s": {p: mean([r["phases_mean_s"].get(p) for r in runs]) for p in PHASES},
            "overhead_s": mean([r["overhead_s"] for r in runs]),
            "overhead_fraction": mean([r["overhead_fraction"] for r in runs]),
            "predicted_s_per_iter": {k: mean([r["predicted_s_per_iter"].get(k) for r in runs]) for k in pred_keys},
            "peak_mem_gb": max((r["peak_mem_gb"] for r in runs if r.get("peak_mem_gb") is not None), default=None),
            "paper_s_per_iter": paper_value(result, "s_per_iter", name),
            "speedups": list(first.get("speedups") or []),
            "ratio_guard": _guard_summary(runs),
        }
    return out


def _guard_summary(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ratio guard over an algorithm's seeds (the largest error, each seed's, the tolerance); ``None`` when it did
    not run (no speed-up on, or a ``bench.json`` from before the guard)."""
    checks = [r["ratio_guard"] for r in runs if r.get("ratio_guard")]
    if not checks:
        return None
    return {
        "max_error": max(float(c["max_error"]) for c in checks),
        "per_seed": [float(c["max_error"]) for c in checks],
        "edges": [int(c["edges"]) for c in checks],
        "tolerance": float(checks[0]["tolerance"]),
        "seconds_mean": mean([c["seconds"] for c in checks]),
    }
