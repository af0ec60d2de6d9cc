"""The bench recipe: ``bench`` (what to run and how), ``algorithms`` (one overlay per algorithm) and ``paper`` (the
published numbers printed next to ours, kept in the recipe rather than in code: ``recipes/bench/digits.yaml``).

:func:`load_bench` reads it within the limits of a training recipe (:func:`rlpost.engine.recipe.sources.read_yaml`:
size, encoding, nesting, aliases, entries, duplicate keys) and checks it, listing every problem with its field before
anything is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

import rlpost.bench.stats as stats
from rlpost.bench.field_spec import parse_claims, parse_levels
from rlpost.bench.paper import PAPER_QUANTITIES, parse_paper
from rlpost.core.shipped import resolve_relative
from rlpost.core.yaml_limits import load_yaml, short_repr
from rlpost.engine.recipe import RecipeError
from rlpost.engine.recipe.paths import resolve_doc_paths
from rlpost.engine.recipe.sources import read_yaml

__all__ = ["PAPER_QUANTITIES", "AlgoSpec", "BenchSpec", "as_names", "load_bench"]


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
    ``levels`` are fixed values of the primary held-out metric whose time to reach the report gives for every
    algorithm; ``claims`` are ``{fast, slow, published}`` pairs of algorithms with a published speed-up
    (:mod:`rlpost.bench.field`).
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
    levels: list[float] = field(default_factory=list)
    claims: list[dict[str, str]] = field(default_factory=list)

    @property
    def fast_names(self) -> list[str]:
        """``fast`` as a list."""
        return as_names(self.fast)


def as_names(value: Any) -> list[str]:
    """``None``, one name or several names as a list of names."""
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


KNOWN = (
    "output_dir base seeds num_seeds schedule time_budget_s max_iterations eval_every reference fast metric bootstrap "
    "calibration overrides levels claims"
).split()
"""The keys of the ``bench`` section."""


def load_bench(path: str, overrides: Sequence[tuple[str, str]] = ()) -> BenchSpec:
    """Read a bench recipe; ``overrides`` are ``("bench.key", "yaml value")`` pairs (``--bench.max_iterations 3``).

    Raises:
        RecipeError: An unreadable file or one beyond the YAML limits, unknown keys or a bad value (every problem
            listed).
    """
    path = resolve_relative(path)  # recipes/bench/NAME.yaml names the shipped bench recipe from any directory
    # Relative paths (bench.base, each algorithm's recipes) resolve against the bench file (rlpost/core/shipped.py).
    data = resolve_doc_paths(read_yaml(path, "bench recipe"), path)
    problems = [
        f"{k}: unknown top-level key (known: algorithms, bench, paper)"
        for k in data
        if k not in ("bench", "algorithms", "paper")
    ]
    bench = _mapping(data.get("bench"), "bench", problems)
    for dotted, raw in overrides:
        parts = dotted.split(".")
        if parts[0] != "bench" or len(parts) != 2:
            problems.append(f"--{dotted}: bench overrides look like --bench.KEY VALUE")
            continue
        try:
            bench[parts[1]] = load_yaml(raw, f"--{dotted}")
        except yaml.YAMLError as exc:
            problems.append(f"--{dotted}: not valid YAML: {exc}")
    problems += [f"bench.{k}: unknown key (known: {', '.join(sorted(KNOWN))})" for k in bench if k not in KNOWN]
    specs = _algorithms(data.get("algorithms"), problems)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        problems.append(f"algorithms: names must be unique, got {names}")
    schedule = _typed(bench, "schedule", "least-time", str, "a string", problems)
    if schedule not in ("least-time", "round-robin"):
        problems.append(f"bench.schedule: 'least-time' or 'round-robin', got {short_repr(schedule)}")
    calib = _mapping(bench.get("calibration"), "bench.calibration", problems)
    boot = _mapping(bench.get("bootstrap"), "bench.bootstrap", problems)
    problems += [
        f"bench.bootstrap.{k}: unknown key (known: confidence, resamples, seed)"
        for k in boot
        if k not in ("resamples", "confidence", "seed")
    ]
    sizes = calib.get("batch_sizes", [1, 4, 16, 64])
    if not isinstance(sizes, list) or not sizes or any(_not_int(b) or b < 1 for b in sizes):
        problems.append(
            f"bench.calibration.batch_sizes: a non-empty list of positive integers, got {short_repr(sizes)}"
        )
        sizes = [1]
    budget = _typed(bench, "time_budget_s", None, (int, float), "a number of seconds or null", problems)
    fast = bench.get("fast")
    if not (fast is None or isinstance(fast, str) or _strings(fast)):
        problems.append(f"bench.fast: a name or a list of names, got {short_repr(fast)}")
        fast = None
    spec = BenchSpec(
        output_dir=_typed(bench, "output_dir", "runs/bench", str, "a directory", problems),
        base=_paths(bench.get("base"), "bench.base", problems),
        algorithms=specs,
        schedule=schedule,
        time_budget_s=None if budget is None else float(budget),
        max_iterations=_typed(bench, "max_iterations", 10, int, "an integer", problems),
        eval_every=_typed(bench, "eval_every", 0, int, "an integer", problems),
        reference=_typed(bench, "reference", None, str, "an algorithm name", problems),
        fast=fast,
        calibration_repeats=_typed(calib, "repeats", 5, int, "an integer", problems, "bench.calibration"),
        calibration_batch_sizes=[int(b) for b in sizes],
        overrides=_mapping(bench.get("overrides"), "bench.overrides", problems),
        seeds=_parse_seeds(bench, problems),
        metric=_typed(bench, "metric", None, str, "a metric name", problems),
        bootstrap_resamples=_typed(
            boot, "resamples", stats.DEFAULT_RESAMPLES, int, "an integer", problems, "bench.bootstrap"
        ),
        confidence=float(
            _typed(boot, "confidence", stats.DEFAULT_CONFIDENCE, (int, float), "a number", problems, "bench.bootstrap")
        ),
        bootstrap_seed=_typed(boot, "seed", 0, int, "an integer", problems, "bench.bootstrap"),
        paper=parse_paper(data.get("paper"), names, problems),
        levels=parse_levels(bench.get("levels"), problems),
        claims=parse_claims(bench.get("claims"), names, problems),
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


def _algorithms(algos: Any, problems: list[str]) -> list[AlgoSpec]:
    """The ``algorithms`` list as :class:`AlgoSpec`, each problem named ``algorithms[i]...``."""
    if not isinstance(algos, list) or not algos:
        problems.append("algorithms: give a non-empty list of {name, recipes}")
        return []
    specs: list[AlgoSpec] = []
    for i, a in enumerate(algos):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str):
            problems.append(f"algorithms[{i}]: needs a name")
            continue
        extra = set(a) - {"name", "label", "preset", "recipes", "overrides"}
        if extra:
            problems.append(
                f"algorithms[{i}]: unknown keys {sorted(extra)} (known: name, label, preset, recipes, overrides)"
            )
        specs.append(
            AlgoSpec(
                a["name"],
                str(a.get("label", a["name"])),
                _paths(a.get("recipes"), f"algorithms[{i}].recipes", problems),
                _mapping(a.get("overrides"), f"algorithms[{i}].overrides", problems),
                str(a.get("preset") or ""),
            )
        )
    return specs


def _typed(
    section: dict[str, Any],
    key: str,
    default: Any,
    types: type | tuple[type, ...],
    what: str,
    problems: list[str],
    where: str = "bench",
) -> Any:
    """``section[key]`` (``default`` when absent, or null where the default is) if it is of ``types``, else
    ``default`` and a problem naming the field."""
    value = section.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, types) and not isinstance(value, bool):  # no field takes a bool; True is an int in Python
        return value
    problems.append(f"{where}.{key}: expected {what}, got {short_repr(value)}")
    return default


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _mapping(value: Any, where: str, problems: list[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    problems.append(f"{where}: expected a mapping, got {short_repr(value)}")
    return {}


def _paths(value: Any, where: str, problems: list[str]) -> list[str]:
    """One recipe path or a list of them."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if _strings(value):
        return list(value)
    problems.append(f"{where}: expected a recipe path or a list of them, got {short_repr(value)}")
    return []


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
