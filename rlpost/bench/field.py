"""The field's comparisons: every algorithm against every other (not one reference against the fast ones).

* **Time to fixed held-out levels** (``bench.levels``, values of the primary metric fixed before the bench runs) and
  to the **best peer's level** (the highest mean final value among the algorithms that are not ``bench.fast``: the
  level a fast method must reach to be ahead of the whole field). A seed that never reached a level within its
  budget is *censored*: its time is counted as its whole training time, a lower bound of the time it would have
  needed, so an algorithm with censored seeds can only look faster than it is. The fastest algorithm (all seeds
  reached, lowest mean) is called ahead of another only where their intervals separate. Each second judge's value
  at that first evaluation is kept: a level reached while the judge lags says the reward, not the images, got there.
* **Final ranking** on every held-out metric: the algorithm with the highest mean final value, and which others
  its interval separates from.
* **The late fall**: per algorithm and held-out metric, each seed's best evaluation minus its final one (a second
  judge that peaks and falls while the training reward holds is the reward-hacking signature).
* **The reward-hacking alarm's verdict** per run (:func:`alarm_verdicts`, the detector of
  :mod:`rlpost.engine.evaluation.alarm` replayed over the run's saved evaluation images).
* **Published claims** (``bench.claims``): for a pair (fast, slow) with a published speed-up, the s/iter ratio and
  the time ratio to the slow method's mean best level against the time it took to reach its own best
  (:func:`rlpost.bench.compare.own_best`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import rlpost.bench.stats as stats
from rlpost.bench.aggregate import eval_keys, numeric, primary_metric, runs_by_algorithm, stats_kwargs
from rlpost.bench.compare import best_value, final_value, own_best
from rlpost.bench.spec import as_names

__all__ = ["alarm_verdicts", "field_comparisons"]


def _censored_times(
    runs: list[dict[str, Any]], key: str, level: float, judges: list[str], kw: dict[str, Any]
) -> dict[str, Any]:
    """Each seed's training time at its first evaluation at or above ``level``; a seed that never got there counts
    its whole training time (a lower bound) and is marked in ``censored``. ``judges``: each judge's value at that
    evaluation (over the seeds that reached the level), so a level reached by hacking the reward shows."""
    hits = [stats.first_reach(r["evals"], key, level) for r in runs]
    times = [float(h["train_time_s"]) if h else float(r["train_time_s"]) for h, r in zip(hits, runs, strict=True)]
    return {
        "n": len(runs),
        "reached": sum(h is not None for h in hits),
        "censored": [h is None for h in hits],
        "times_s": times,
        "iterations": [int(h["iteration"]) if h else None for h in hits],
        "time_s": stats.summarize(times, **kw),
        "judges": {j: stats.summarize([numeric(h.get(j)) if h else None for h in hits], **kw) for j in judges},
    }


def _level_entry(
    by_algo: dict[str, list[dict[str, Any]]],
    key: str,
    level: float,
    source: str,
    judges: list[str],
    kw: dict[str, Any],
) -> dict[str, Any]:
    """Every algorithm's (censored) time to ``level`` and who is ahead of whom with separated intervals."""
    times = {name: _censored_times(runs, key, level, judges, kw) for name, runs in by_algo.items()}
    complete = [n for n, t in times.items() if t["reached"] == t["n"]]
    fastest = min(complete, key=lambda n: times[n]["time_s"]["mean"]) if complete else None
    ahead_of: list[str] = []
    not_separated: list[str] = []
    if fastest is not None:
        mine = times[fastest]["time_s"]
        for name, t in times.items():
            if name == fastest:
                continue
            below = stats.verdict(mine, t["time_s"]) == "separated" and mine["mean"] < t["time_s"]["mean"]
            (ahead_of if below else not_separated).append(name)
    return {
        "metric": key,
        "level": level,
        "source": source,
        "by_algorithm": times,
        "fastest": fastest,
        "ahead_of": ahead_of,
        "not_separated": not_separated,
    }


def _ranking(by_algo: dict[str, list[dict[str, Any]]], key: str, kw: dict[str, Any]) -> dict[str, Any]:
    """Mean final values, the top algorithm, and the algorithms its interval lies above (separated) or not."""
    finals = {name: stats.summarize([final_value(r, key) for r in runs], **kw) for name, runs in by_algo.items()}
    scored = [n for n, s in finals.items() if s["n"]]
    if not scored:
        return {"final": finals, "top": None, "above": [], "not_separated": []}
    top = max(scored, key=lambda n: finals[n]["mean"])
    above = [n for n in scored if n != top and stats.verdict(finals[top], finals[n]) == "separated"]
    return {
        "final": finals,
        "top": top,
        "above": above,
        "not_separated": [n for n in scored if n not in (top, *above)],
    }


def _late_fall(runs: list[dict[str, Any]], key: str, kw: dict[str, Any]) -> dict[str, Any]:
    """Per seed: best evaluation minus final evaluation of ``key`` (0 when the last evaluation is the best)."""
    falls = []
    for run in runs:
        best, final = best_value(run, key), final_value(run, key)
        falls.append(None if best is None or final is None else best - final)
    return stats.summarize(falls, **kw)


def _claims(
    result: dict[str, Any], by_algo: dict[str, list[dict[str, Any]]], metric: str, kw: dict[str, Any]
) -> list[dict[str, Any]]:
    """Each ``bench.claims`` pair: s/iter ratio and the own-best time-to-reward ratio (slow / fast, > 1 favours
    the fast method), next to the published claim."""
    out = []
    for claim in result.get("spec", {}).get("claims") or []:
        fast, slow = claim["fast"], claim["slow"]
        if fast not in by_algo or slow not in by_algo:
            continue
        medians = {n: [r["s_per_iter"]["median"] for r in by_algo[n]] for n in (fast, slow)}
        s_ratio = stats.ratio_summary(medians[slow], medians[fast], **kw)
        s_ratio["vs_1"] = stats.verdict(s_ratio, (1.0, 1.0))
        out.append(
            {
                **claim,
                "s_per_iter": s_ratio,
                "own_best": own_best(by_algo, slow, [fast], metric, kw),
            }
        )
    return out


def field_comparisons(result: dict[str, Any]) -> dict[str, Any]:
    """The field's comparisons (module docstring) of a bench result with ``runs``, on every held-out metric and
    the primary one (:func:`rlpost.bench.aggregate.primary_metric`); empty without one."""
    by_algo, keys, metric = runs_by_algorithm(result), eval_keys(result), primary_metric(result)
    if metric is None or not by_algo:
        return {}
    kw = stats_kwargs(result)
    spec = result.get("spec", {})
    fast = set(as_names(spec.get("fast")))
    judges = [k for k in keys if "/judge/" in k]
    levels = [_level_entry(by_algo, metric, float(v), "fixed", judges, kw) for v in spec.get("levels") or []]
    peers = {n: stats.summarize([final_value(r, metric) for r in runs], **kw) for n, runs in by_algo.items()}
    peers = {n: s for n, s in peers.items() if n not in fast and s["n"]}
    if peers and fast:
        best_peer = max(peers, key=lambda n: peers[n]["mean"])
        level = peers[best_peer]["mean"]
        levels.append(_level_entry(by_algo, metric, level, f"best peer: {best_peer}", judges, kw))
    return {
        "metric": metric,
        "levels": levels,
        "ranking": {key: _ranking(by_algo, key, kw) for key in keys},
        "late_fall": {key: {n: _late_fall(runs, key, kw) for n, runs in by_algo.items()} for key in keys},
        "alarm": {n: [r.get("alarm") for r in runs] for n, runs in by_algo.items()},
        "claims": _claims(result, by_algo, metric, kw),
    }


def alarm_verdicts(result: dict[str, Any], out_dir: Path | None = None) -> None:
    """Replay the reward-hacking alarm (default thresholds, :class:`~rlpost.engine.evaluation.AlarmConfig`) over
    every run of ``result`` that has none recorded, and store ``run["alarm"]``: ``{"fired_iteration": int | None,
    "reasons": [...], "max_judge_drop": float}``, or ``{"error": why}`` when the run's evaluations cannot be
    replayed (no saved images, a moved directory). ``out_dir``: where the run directories are, when not at the
    recorded ``run_dir`` (a copied bench output)."""
    from rlpost.apps.alarm_replay import replay
    from rlpost.engine.evaluation import AlarmConfig

    config = AlarmConfig(enabled=True)
    for key, run in (result.get("runs") or {}).items():
        if run.get("alarm") is not None:
            continue
        run_dir = Path(run["run_dir"]) if run.get("run_dir") else None
        if out_dir is not None and (out_dir / key).is_dir():
            run_dir = out_dir / key
        if run_dir is None:
            run["alarm"] = {"error": "no run directory recorded"}
            continue
        try:
            records = replay(run_dir, config)
        except (FileNotFoundError, KeyError, ValueError, OSError) as exc:
            run["alarm"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        fired = next((r for r in records if r["active"]), None)
        drops = [v for r in records for v in r["judge_drop"].values() if numeric(v) is not None]
        run["alarm"] = {
            "fired_iteration": None if fired is None else int(fired["step"]),
            "reasons": [] if fired is None else list(fired["reasons"]),
            "max_judge_drop": max(drops) if drops else math.nan,
        }
