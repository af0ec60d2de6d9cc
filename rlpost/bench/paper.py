"""The ``paper`` section of a bench recipe: the published numbers printed next to ours (never used in a computation
of ours), normalised by :func:`parse_paper` with every problem named by its field."""

from __future__ import annotations

from typing import Any

from rlpost.core.yaml_limits import short_repr

__all__ = ["PAPER_QUANTITIES", "parse_paper"]

PAPER_QUANTITIES = ("s_per_iter", "time_to_reward")
"""Published quantities a bench recipe's ``paper`` section may give per algorithm (printed next to ours)."""


def parse_paper(raw: Any, names: list[str], problems: list[str]) -> dict[str, Any]:
    """``paper`` as ``{"source": str, "notes": {name: str}, QUANTITY: {"source": str, "values": {name: float},
    "notes": {name: str}}}``; every problem is appended to ``problems`` naming its field."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("paper: expected a mapping {source, s_per_iter, time_to_reward, notes}")
        return {}
    known = {"source", "notes", *PAPER_QUANTITIES}
    problems += [f"paper.{k}: unknown key (known: {', '.join(sorted(known))})" for k in raw if k not in known]
    out: dict[str, Any] = {"source": str(raw.get("source", "")), "notes": {}}
    notes = raw.get("notes") or {}
    if not isinstance(notes, dict):
        problems.append(f"paper.notes: expected a mapping {{algorithm: text}}, got {short_repr(notes)}")
        notes = {}
    for name, note in notes.items():
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
                problems.append(f"{where}: expected a positive number (or {{value, note}}), got {short_repr(value)}")
                continue
            parsed["values"][str(name)] = float(value)
            if note:
                parsed["notes"][str(name)] = str(note)
        out[qty] = parsed
    return out
