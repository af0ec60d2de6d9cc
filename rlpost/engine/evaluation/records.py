"""The evaluation's records: one ``eval.jsonl`` line per evaluation and the ``eval.md`` tables regenerated from them.

A line holds the step, the NFE, the set and judge names, the means (``eval/...``), ``eval_sec`` (sampling and scoring,
so a run's evaluation share is visible), the alarm's record when it is enabled and every prompt's scores
(``per_prompt``: set, prompt, seed and one column per reward and ``judge/<name>``). The readers below serve the run's
own table and the applications that read finished runs (``rlpost.apps.reporting``, ``alarm_replay``, ``export``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlpost.engine.evaluation.config import EvalSpec
from rlpost.engine.evaluation.keys import metric_key
from rlpost.engine.rundir import json_safe

__all__ = [
    "JSONL",
    "TABLE",
    "append_record",
    "eval_columns",
    "eval_record",
    "eval_sets",
    "markdown_table",
    "read_evals",
    "write_table",
]

JSONL = "eval.jsonl"
"""One line per evaluation, in the run directory."""
TABLE = "eval.md"
"""Markdown tables of every evaluation so far, in the run directory (regenerated from :data:`JSONL`)."""

SetScores = dict[str, list[float]]
"""Per-image scores of one set by column (``<reward>``, ``judge/<judge>``)."""


def eval_record(
    step: int,
    spec: EvalSpec,
    prompts: dict[str, list[str]],
    scores: dict[str, SetScores],
    metrics: dict[str, float],
    alarm: dict[str, Any] | None = None,
    frames: int = 1,
) -> dict[str, Any]:
    """The ``eval.jsonl`` record of one evaluation (``prompts`` and ``scores`` by set name, in recipe order; prompt
    ``i`` of every set used seed ``eval.seed + i``). ``frames``: frames per sample, recorded for video (absent: 1),
    so readers of the saved PNGs (frames stacked top to bottom) can split them."""
    seed = spec.settings.seed
    per_prompt: list[dict[str, Any]] = []
    for name, set_prompts in prompts.items():
        for i, p in enumerate(set_prompts):
            per_prompt.append(
                {**({"set": name} if name else {}), "prompt": p, "seed": seed + i}
                | {column: v[i] for column, v in scores[name].items()}
            )
    return {
        "step": step,
        "num_steps": spec.settings.num_steps,
        **({"frames": frames} if frames > 1 else {}),
        **({"sets": list(prompts)} if any(prompts) else {}),
        **({"judges": [j.name for j in spec.judges]} if spec.judges else {}),
        **{k: v for k, v in metrics.items() if k.startswith("eval/")},
        "eval_sec": round(metrics["perf/eval_sec"], 3),  # sampling + scoring, so a run's eval share is visible
        **({"alarm": alarm} if alarm is not None else {}),
        "per_prompt": per_prompt,
    }


def append_record(output_dir: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to ``eval.jsonl`` and regenerate ``eval.md``."""
    with (output_dir / JSONL).open("a") as fh:
        fh.write(json.dumps(json_safe(record)) + "\n")
    write_table(output_dir)


def read_evals(output_dir: Path) -> list[dict[str, Any]]:
    """Records of ``eval.jsonl`` (empty when absent)."""
    path = output_dir / JSONL
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_sets(records: Sequence[dict[str, Any]]) -> list[str]:
    """The evaluation set names of these records, in recipe order; ``[""]`` for a single unnamed prompt source."""
    names: list[str] = []
    for r in records:
        names += [n for n in r.get("sets", []) if isinstance(n, str) and n not in names]
    return names or [""]


def eval_columns(records: Sequence[dict[str, Any]], set_name: str) -> list[str]:
    """Metric keys of one set: its rewards (sorted), then its judges (sorted)."""
    prefix = metric_key(set_name, "")
    keys = {k for r in records for k in r if k.startswith(prefix)}
    judge = metric_key(set_name, "", judge=True)
    return sorted(keys, key=lambda k: (k.startswith(judge), k))


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Markdown tables: per evaluation set, one row per evaluation and one column per reward and judge."""
    if not records:
        return "_no held-out evaluation recorded_\n"
    parts: list[str] = []
    if any(r.get("judges") for r in records):
        parts.append("Columns `judge/<name>` are second judges: scored here, never trained on.\n")
    for name in eval_sets(records):
        keys = eval_columns(records, name)
        prefix = metric_key(name, "")
        lines = [f"## {name}\n"] if name else []
        lines.append("| step | " + " | ".join(k.removeprefix(prefix) for k in keys) + " |")
        lines.append("|---:|" + "---:|" * len(keys))
        for r in records:
            cells = [f"{r[k]:.4f}" if isinstance(r.get(k), (int, float)) else "" for k in keys]
            lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def write_table(output_dir: Path) -> None:
    """Regenerate ``eval.md`` from ``eval.jsonl``."""
    (output_dir / TABLE).write_text("# Held-out evaluation\n\n" + markdown_table(read_evals(output_dir)))
