"""The bench recipe: ``bench`` (what to run and how), ``algorithms`` (one overlay per algorithm) and ``paper`` (the
published numbers printed next to ours, kept in the recipe rather than in code: ``recipes/bench/digits.yaml``).

:func:`load_bench` reads and checks it, listing every problem with its field before anything is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import rlpost.bench.stats as stats
from rlpost.engine.recipe import RecipeError

__all__ = ["PAPER_QUANTITIES", "AlgoSpec", "BenchSpec", "as_names", "load_bench"]

PAPER_QUANTITIES = ("s_per_iter", "time_to_reward")
"""Published quantities a bench recipe's ``paper`` section may give per algorithm (printed next to ours)."""


@dataclass
class AlgoSpec:
    """One benchmarked algorithm: overlays on the shared base.

    Attributes:
        name: Short name (run directory, JSON keys).
        label: Display name in tables and plots.
        recipes: Overlay recipe files merged after the bench's base.
        overrides: ``{"a.b": value}`` applied last (as ``--a.b value``).
        preset: Which preset produced its numbers (named in every results table); defaults to ``name``.
    """

    name: str
    label: str
    recipes: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    preset: str = ""

    def __post_init__(self) -> None:
        self.preset = self.preset or self.name


@dataclass
class BenchSpec:
    """The ``bench`` section, the algorithms and the ``paper`` section (see the module docstring).

    ``seeds=None`` runs each algorithm once with its recipe's own ``run.seed``. ``fast`` is one name or several.
    ``paper`` is normalised by :func:`load_bench` to ``{"source": str, "notes": {name: str}, QUANTITY: {"source":
    str, "values": {name: float}, "notes": {name: str}}}``.
    """

    output_dir: str
    base: list[str]
    algorithms: list[AlgoSpec]
    schedule: str = "least-time"
    time_budget_s: float | None = None
    max_iterations: int = 10
    eval_every: int = 0
    reference: str | None = None
    fast: str | list[str] | None = None
    calibration_repeats: int = 5
    calibration_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    overrides: dict[str, Any] = field(default_factory=dict)
    seeds: list[int] | None = None
    metric: str | None = None
    bootstrap_resamples: int = stats.DEFAULT_RESAMPLES
    confidence: float = stats.DEFAULT_CONFIDENCE
    bootstrap_seed: int = 0
    paper: dict[str, Any] = field(default_factory=dict)

    @property
    def fast_names(self) -> list[str]:
        """``fast`` as a list."""
        return as_names(self.fast)


def as_names(value: Any) -> list[str]:
    """``None``, one name or several names as a list of names."""
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _parse_paper(raw: Any, names: list[str], problems: list[str]) -> dict[str, Any]:
    """Normalise the ``paper`` section (published numbers) and list every problem with its field."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("paper: expected a mapping {source, s_per_iter, time_to_reward, notes}")
        return {}
    known = {"source", "notes", *PAPER_QUANTITIES}
    problems += [f"paper.{k}: unknown key (known: {', '.join(sorted(known))})" for k in raw if k not in known]
    out: dict[str, Any] = {"source": str(raw.get("source", "")), "notes": {}}
    for name, note in dict(raw.get("notes") or {}).items():
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
                problems.append(f"{where}: expected a positive number (or {{value, note}}), got {value!r}")
                continue
            parsed["values"][str(name)] = float(value)
            if note:
                parsed["notes"][str(name)] = str(note)
        out[qty] = parsed
    return out


def load_bench(path: str, overrides: Sequence[tuple[str, str]] = ()) -> BenchSpec:
    """Read a bench recipe; ``overrides`` are ``("bench.key", "yaml value")`` pairs (``--bench.max_iterations 3``).

    Raises:
        RecipeError: Missing file, unknown keys or a bad value (every problem listed).
    """
    p = Path(path)
    if not p.is_file():
        raise RecipeError([f"bench recipe not found: {path}"])
    data = yaml.safe_load(p.read_text()) or {}
    problems: list[str] = []
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: expected a mapping with bench, algorithms and (optionally) paper"])
    problems += [
        f"{k}: unknown top-level key (known: algorithms, bench, paper)"
        for k in data
        if k not in ("bench", "algorithms", "paper")
    ]
    for dotted, raw in overrides:
        parts = dotted.split(".")
        if parts[0] != "bench" or len(parts) != 2:
            problems.append(f"--{dotted}: bench overrides look like --bench.KEY VALUE")
            continue
        data.setdefault("bench", {})[parts[1]] = yaml.safe_load(raw)
    bench = dict(data.get("bench") or {})
    algos = data.get("algorithms") or []
    known = {
        "output_dir",
        "base",
        "seeds",
        "num_seeds",
        "schedule",
        "time_budget_s",
        "max_iterations",
        "eval_every",
        "reference",
        "fast",
        "metric",
        "bootstrap",
        "calibration",
        "overrides",
    }
    problems += [f"bench.{k}: unknown key (known: {', '.join(sorted(known))})" for k in bench if k not in known]
    if not isinstance(algos, list) or not algos:
        problems.append("algorithms: give a non-empty list of {name, recipes}")
        algos = []
    specs: list[AlgoSpec] = []
    for i, a in enumerate(algos):
        if not isinstance(a, dict) or "name" not in a:
            problems.append(f"algorithms[{i}]: needs a name")
            continue
        extra = set(a) - {"name", "label", "preset", "recipes", "overrides"}
        if extra:
            problems.append(
                f"algorithms[{i}]: unknown keys {sorted(extra)} (known: name, label, preset, recipes, overrides)"
            )
        specs.append(
            AlgoSpec(
                str(a["name"]),
                str(a.get("label", a["name"])),
                list(a.get("recipes", [])),
                dict(a.get("overrides") or {}),
                str(a.get("preset") or ""),
            )
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        problems.append(f"algorithms: names must be unique, got {names}")
    schedule = str(bench.get("schedule", "least-time"))
    if schedule not in ("least-time", "round-robin"):
        problems.append(f"bench.schedule: 'least-time' or 'round-robin', got {schedule!r}")
    seeds = _parse_seeds(bench, problems)
    calib = dict(bench.get("calibration") or {})
    boot = dict(bench.get("bootstrap") or {})
    problems += [
        f"bench.bootstrap.{k}: unknown key (known: confidence, resamples, seed)"
        for k in boot
        if k not in ("resamples", "confidence", "seed")
    ]
    spec = BenchSpec(
        output_dir=str(bench.get("output_dir", "runs/bench")),
        base=list(bench.get("base", [])),
        algorithms=specs,
        schedule=schedule,
        time_budget_s=None if bench.get("time_budget_s") is None else float(bench["time_budget_s"]),
        max_iterations=int(bench.get("max_iterations", 10)),
        eval_every=int(bench.get("eval_every", 0)),
        reference=bench.get("reference"),
        fast=bench.get("fast"),
        calibration_repeats=int(calib.get("repeats", 5)),
        calibration_batch_sizes=[int(b) for b in calib.get("batch_sizes", [1, 4, 16, 64])],
        overrides=dict(bench.get("overrides") or {}),
        seeds=seeds,
        metric=None if bench.get("metric") is None else str(bench["metric"]),
        bootstrap_resamples=int(boot.get("resamples", stats.DEFAULT_RESAMPLES)),
        confidence=float(boot.get("confidence", stats.DEFAULT_CONFIDENCE)),
        bootstrap_seed=int(boot.get("seed", 0)),
        paper=_parse_paper(data.get("paper"), names, problems),
    )
    if spec.max_iterations < 1:
        problems.append(f"bench.max_iterations: must be >= 1, got {spec.max_iterations}")
    if spec.time_budget_s is not None and not spec.time_budget_s > 0:
        problems.append(f"bench.time_budget_s: must be > 0 or null, got {spec.time_budget_s}")
    if spec.bootstrap_resamples < 100:
        problems.append(f"bench.bootstrap.resamples: must be >= 100, got {spec.bootstrap_resamples}")
    if not 0.0 < spec.confidence < 1.0:
        problems.append(f"bench.bootstrap.confidence: must be in (0, 1), got {spec.confidence}")
    if spec.metric is not None and not spec.metric.startswith("eval/"):
        problems.append(f"bench.metric: a held-out metric name starting with 'eval/', got {spec.metric!r}")
    for key, values in (("reference", as_names(spec.reference)), ("fast", spec.fast_names)):
        problems += [f"bench.{key}: {v!r} is not one of the algorithms {names}" for v in values if v not in names]
    if spec.reference is not None and spec.reference in spec.fast_names:
        problems.append(f"bench.fast: the reference {spec.reference!r} cannot also be a fast algorithm")
    if problems:
        raise RecipeError(problems)
    return spec


def _parse_seeds(bench: dict[str, Any], problems: list[str]) -> list[int] | None:
    """``seeds: [0, 1, 2]`` or ``num_seeds: 3`` (= seeds 0..2); neither: ``None`` (the recipe's run.seed)."""
    if bench.get("seeds") is not None and bench.get("num_seeds") is not None:
        problems.append("bench.seeds / bench.num_seeds: give one of them, not both")
        return None
    if bench.get("num_seeds") is not None:
        n = bench["num_seeds"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"bench.num_seeds: a positive integer, got {n!r}")
            return None
        return list(range(n))
    raw = bench.get("seeds")
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list) or not raw or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in raw):
        problems.append(f"bench.seeds: a non-empty list of non-negative integers, got {raw!r}")
        return None
    if len(set(raw)) != len(raw):
        problems.append(f"bench.seeds: seeds must be distinct, got {raw}")
        return None
    return [int(s) for s in raw]
