"""The field sections of the bench report (:mod:`rlpost.bench.field`): time to held-out levels for every algorithm,
the final ranking, the late fall with the reward-hacking alarm's verdict, and the published claims."""

from __future__ import annotations

from typing import Any

from rlpost.bench.aggregate import numeric
from rlpost.bench.tables import ci, fmt
from rlpost.engine.evaluation.alarm import STATS

__all__ = ["field_tables"]


def _names(algos: dict[str, Any], names: list[str]) -> str:
    return ", ".join(algos[n]["label"] for n in names) or "none"


def _time_cell(t: dict[str, Any]) -> str:
    """``n/N: mean [lo–hi] s``, with ``>=`` when a seed is censored (never reached: its whole training time)."""
    s = t["time_s"]
    bound = ">=" if any(t["censored"]) else ""
    body = f"{t['reached']}/{t['n']}: {bound}{fmt(s['mean'], '.1f')}"
    if s["n"] > 1 and s["min"] != s["max"]:
        body += f" [{fmt(s['lo'], '.1f')}–{fmt(s['hi'], '.1f')}]"
    return body


def _alarm_cell(verdicts: list[dict[str, Any] | None]) -> str:
    """The alarm per seed: ``silent``, ``fired @ it N``, or why it could not be replayed."""
    cells = []
    for v in verdicts:
        if not v:
            cells.append("–")
        elif "error" in v:
            cells.append("not replayed")
        elif v["fired_iteration"] is None:
            cells.append("silent")
        else:
            cells.append(f"**fired @ it {v['fired_iteration']}** ({_causes(v.get('reasons') or [])})")
    return ", ".join(cells)


def _causes(reasons: list[str]) -> str:
    """What fired the alarm, in short: ``judge`` (a judge fell while the reward rose) and/or the drifted image
    statistics (``brightness``, ``saturation``, ``diversity``), from the detector's reason sentences."""
    found = []
    for reason in reasons:
        cause = "judge" if " judge " in reason else next((w for w in STATS if f"image {w}" in reason), "other")
        if cause not in found:
            found.append(cause)
    return "+".join(found) or "?"


def _level_section(algos: dict[str, Any], levels: list[dict[str, Any]], spec: dict[str, Any]) -> list[str]:
    metric = levels[0]["metric"]
    lines = [
        "",
        f"## The field: time to held-out levels of `{metric}`",
        "",
        "Training time (s) at each seed's first evaluation at or above the level (resolution: every "
        f"{spec.get('eval_every')} iterations). `n/N` seeds reached it; a seed that never did counts its whole "
        "training time (censored, shown `>=`: a lower bound, so censoring only flatters the method). Fixed levels "
        "were set in the bench recipe before it ran; the best peer's level is the highest mean final value among "
        "the methods that are not `bench.fast`.",
        "",
        "| Method | preset | " + " | ".join(f"{lv['level']:.3f} ({lv['source']})" for lv in levels) + " |",
        "|---|---|" + "---:|" * len(levels),
    ]
    for name, a in algos.items():
        cells = [_time_cell(lv["by_algorithm"][name]) for lv in levels if name in lv["by_algorithm"]]
        lines.append(f"| {a['label']} | {a['preset']} | " + " | ".join(cells) + " |")
    judges = list(levels[0]["by_algorithm"][next(iter(levels[0]["by_algorithm"]))].get("judges") or {})
    for judge in judges:
        lines += [
            "",
            f"Second judge `{judge}` at the evaluation where each level was first reached (seeds that reached it):",
            "",
            "| Method | preset | " + " | ".join(f"{lv['level']:.3f}" for lv in levels) + " |",
            "|---|---|" + "---:|" * len(levels),
        ]
        for name, a in algos.items():
            cells = [ci(lv["by_algorithm"][name]["judges"].get(judge)) for lv in levels if name in lv["by_algorithm"]]
            lines.append(f"| {a['label']} | {a['preset']} | " + " | ".join(cells) + " |")
    lines.append("")
    for lv in levels:
        if lv["fastest"] is None:
            lines.append(f"* {lv['level']:.3f} ({lv['source']}): no method reached it in every seed.")
            continue
        lines.append(
            f"* {lv['level']:.3f} ({lv['source']}): fastest {algos[lv['fastest']]['label']}; ahead with separated "
            f"intervals of {_names(algos, lv['ahead_of'])}; not separated from {_names(algos, lv['not_separated'])}."
        )
    return lines


def _ranking_section(algos: dict[str, Any], ranking: dict[str, Any]) -> list[str]:
    lines = ["", "## The field: final held-out ranking (a place only where intervals separate)", ""]
    for key, r in ranking.items():
        if r["top"] is None:
            continue
        lines.append(
            f"* `{key}`: highest mean final {algos[r['top']]['label']} ({ci(r['final'][r['top']])}); above "
            f"{_names(algos, r['above'])} with separated intervals; not separated from "
            f"{_names(algos, r['not_separated'])}."
        )
    return lines


def _fall_section(algos: dict[str, Any], field: dict[str, Any]) -> list[str]:
    keys = list(field["late_fall"])
    lines = [
        "",
        "## The field: late fall (each seed's best evaluation minus its final one) and the reward-hacking alarm",
        "",
        "The alarm is the detector of rlpost/engine/evaluation/alarm.py at its default thresholds, replayed over each "
        "run's saved evaluation images after the bench (the bench runs train with it off); one verdict per seed, with "
        "its cause: `judge` (the second judge fell while the reward rose) or the image statistic that drifted.",
        "",
        "| Method | preset | " + " | ".join(f"`{k}` fall" for k in keys) + " | alarm per seed |",
        "|---|---|" + "---:|" * len(keys) + "---|",
    ]
    for name, a in algos.items():
        cells = [ci(field["late_fall"][k].get(name)) for k in keys]
        lines.append(
            f"| {a['label']} | {a['preset']} | " + " | ".join(cells) + f" | {_alarm_cell(field['alarm'][name])} |"
        )
    return lines


def _claims_section(algos: dict[str, Any], claims: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Published speed-ups at this scale (slow / fast; > 1 favours the fast method)",
        "",
        "Time ratio: the slow method's mean time to its own best evaluation over the fast method's time to that "
        "level (the slow method's mean best), only when every fast seed reached it.",
        "",
        "| Fast | Slow | published | s/iter ratio | time-to-reward ratio | fast seeds that reached |",
        "|---|---|---|---:|---:|---:|",
    ]
    for c in claims:
        ob = c.get("own_best") or {}
        ratio = (ob.get("ratios") or {}).get(c["fast"]) or {}
        t = (ob.get("by_algorithm") or {}).get(c["fast"]) or {}
        if "not_reached" in ratio or numeric(ratio.get("mean")) is None:
            time_cell = "not computed"
        else:
            time_cell = f"{ratio['mean']:.2f}x [{ratio['lo']:.2f}–{ratio['hi']:.2f}] ({ratio['vs_1']} from 1)"
        s = c["s_per_iter"]
        lines.append(
            f"| {algos[c['fast']]['label']} | {algos[c['slow']]['label']} | {c['published']} | "
            f"{s['mean']:.2f}x [{s['lo']:.2f}–{s['hi']:.2f}] | {time_cell} | "
            f"{t.get('reached', '–')}/{t.get('n', '–')} |"
        )
    return lines


def field_tables(result: dict[str, Any], algos: dict[str, Any]) -> list[str]:
    """Every field section the result has (nothing for a bench without a held-out metric)."""
    field = result.get("field") or {}
    if not field:
        return []
    lines: list[str] = []
    if field.get("levels"):
        lines += _level_section(algos, field["levels"], result.get("spec", {}))
    lines += _ranking_section(algos, field.get("ranking") or {})
    if field.get("late_fall"):
        lines += _fall_section(algos, field)
    if field.get("claims"):
        lines += _claims_section(algos, field["claims"])
    return lines
