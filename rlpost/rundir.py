"""The run directory: resolved recipe, versions, metrics JSONL and end-of-run summary.

The resolved recipe and the version manifest are written once, when the run starts, and never overwritten: starting
a new run in a directory that already holds a recipe is an error (resuming is the only way back into it). A resume
(:meth:`RunDirectory.reopen`) checks the stored recipe instead, drops metric lines logged after the checkpoint it
continues from (they will be logged again), and records itself in ``resumes.jsonl``.

Layout::

    recipe.yaml  versions.json  metrics.jsonl  summary.json  resumes.jsonl
    eval.jsonl  eval.md  eval/step_N.png  eval/step_N/0000.png     (held-out evaluation)
    grids/step_N.png                                               (training samples, logging.grid_every)
    checkpoints/step_N/                                            (rlpost.checkpoint)
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

import yaml

from rlpost.plugins import PluginHost

__all__ = ["RunDirectory", "json_safe"]

_PACKAGES = (
    "rlpost",
    "torch",
    "diffusers",
    "transformers",
    "peft",
    "pluggy",
    "jsonargparse",
    "deepspeed",
    "open_clip_torch",
)


def json_safe(obj: Any) -> Any:
    """Replace NaN/inf floats by ``None`` recursively (strict JSON has no NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


class RunDirectory:
    """Files of one run.

    Args:
        path: The run directory.
    """

    RECIPE = "recipe.yaml"
    VERSIONS = "versions.json"
    METRICS = "metrics.jsonl"
    SUMMARY = "summary.json"

    def __init__(self, path: Path) -> None:
        self.path = path

    def create(self, config: dict[str, Any], host: PluginHost) -> None:
        """Create the directory and write the resolved recipe and versions.

        Raises:
            FileExistsError: If the directory already holds a run's recipe (never overwritten).
        """
        recipe_file = self.path / self.RECIPE
        if recipe_file.exists():
            raise FileExistsError(
                f"{recipe_file} already exists: refusing to overwrite another run's recipe; choose a new run.output_dir"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        recipe_file.write_text(yaml.safe_dump(config, sort_keys=False))
        versions = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "packages": {name: _version(name) for name in _PACKAGES},
            "plugins": [
                {"name": p.name, "distribution": p.distribution, "version": p.version, "status": p.status}
                for p in host.plugins(include_builtin=True)
            ],
        }
        (self.path / self.VERSIONS).write_text(json.dumps(versions, indent=2))

    def stored_recipe(self) -> dict[str, Any]:
        """The resolved recipe written when the run started.

        Raises:
            FileNotFoundError: The directory holds no run.
        """
        recipe_file = self.path / self.RECIPE
        if not recipe_file.is_file():
            raise FileNotFoundError(f"{recipe_file} not found: {self.path} is not a run directory")
        data = yaml.safe_load(recipe_file.read_text())
        return data if isinstance(data, dict) else {}

    def reopen(self, step: int, checkpoint: str, changed: list[str]) -> list[dict[str, float]]:
        """Continue this run after ``step`` completed steps: truncate ``metrics.jsonl``/``eval.jsonl`` to steps
        ``<= step`` (a crashed run may have logged further), note the resume, and return the kept metric history."""
        history: list[dict[str, float]] = []
        for name in (self.METRICS, "eval.jsonl"):
            path = self.path / name
            if not path.is_file():
                continue
            kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
            path.write_text("".join(ln + "\n" for ln in kept))
            if name == self.METRICS:
                for line in kept:
                    record = json.loads(line)
                    record.pop("step", None)
                    history.append({k: (math.nan if v is None else float(v)) for k, v in record.items()})
        with (self.path / "resumes.jsonl").open("a") as fh:
            fh.write(json.dumps({"step": step, "checkpoint": checkpoint, "changed": changed}) + "\n")
        return history

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Append one JSON line ``{"step": step, **metrics}`` to ``metrics.jsonl``."""
        with (self.path / self.METRICS).open("a") as fh:
            fh.write(json.dumps(json_safe({"step": step, **metrics})) + "\n")

    def write_summary(self, status: str, steps: int, history: list[dict[str, float]]) -> None:
        """Write ``summary.json``: status, steps, first and last value of every metric."""
        summary: dict[str, Any] = {"status": status, "steps": steps, "metrics": {}}
        if history:
            for key, last in history[-1].items():
                summary["metrics"][key] = {"first": history[0].get(key), "last": last}
        (self.path / self.SUMMARY).write_text(json.dumps(json_safe(summary), indent=2))
