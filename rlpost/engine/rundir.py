"""The run directory: resolved recipe, versions, metrics JSONL and end-of-run summary.

The resolved recipe and the version manifest are written when the run starts and never overwritten once the run has
trained: starting a new run in a directory that holds a trained run is an error (resuming is the only way back into
it); a directory left by a start that failed before its first step (recipe and versions only) is reused. A resume
(:meth:`RunDirectory.reopen`) checks the stored recipe instead, drops metric lines logged after the checkpoint it
continues from (they will be logged again), and records itself in ``resumes.jsonl``.

Layout::

    recipe.yaml  versions.json  metrics.jsonl  summary.json  resumes.jsonl
    eval.jsonl  eval.md  eval/step_N.png  eval/step_N/0000.png     (held-out evaluation)
    grids/step_N.png                                               (training samples, logging.grid_every)
    checkpoints/step_N/                                            (rlpost.engine.checkpoint)
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import platform
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rlpost.core.plugins import PluginInfo
from rlpost.engine.checkpoint import CHECKPOINT_DIR, CheckpointError, list_checkpoints

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


def _read_jsonl_repairing_tail(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file whose last line may be torn (a crash or a full disk in the middle of an append).

    A torn last line is dropped with a warning: it belongs to a step after the last checkpoint, which the resumed run
    logs again. A bad line anywhere else is real corruption and is not guessed around.

    Raises:
        CheckpointError: A line other than the last is not a JSON object (names the file and line).
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(n, ln) for n, ln in enumerate(lines, 1) if ln.strip()]
    records: list[dict[str, Any]] = []
    for i, (n, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            if i == len(numbered) - 1:
                warnings.warn(
                    f"{path}:{n}: dropping a torn last line (an interrupted append): {line[:80]!r}",
                    UserWarning,
                    stacklevel=3,
                )
                break
            raise CheckpointError(f"{path}:{n}: corrupt line ({exc}); fix or remove it before resuming") from None
        records.append(record)
    return records


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

    def trained(self) -> list[str]:
        """What in this directory shows that a run trained here (empty for a start that failed before step 1).

        A complete checkpoint, logged metrics or evaluations, grids, a summary or a resume record count; the recipe,
        versions and empty folders written by a start that failed while loading do not.
        """
        found = [f"{CHECKPOINT_DIR}/{c.path.name}" for c in list_checkpoints(self.path)[-1:]]
        for name in (self.METRICS, "eval.jsonl", self.SUMMARY, "resumes.jsonl"):
            f = self.path / name
            if f.is_file() and f.stat().st_size > 0:
                found.append(name)
        for name in ("grids", "eval"):
            d = self.path / name
            if d.is_dir() and any(d.iterdir()):
                found.append(name + "/")
        return found

    def create(self, config: dict[str, Any], plugins: Sequence[PluginInfo]) -> None:
        """Create the directory and write the resolved recipe and versions (``plugins``: every plugin the host knows,
        built-ins included, as ``PluginHost.plugins(include_builtin=True)`` lists them).

        A directory whose recipe was written by a start that failed before training (:meth:`trained` finds nothing)
        is reused: its recipe and versions are replaced, with a warning, so a fixed retry does not need a new
        ``run.output_dir``.

        Raises:
            FileExistsError: If the directory already holds a run that trained (never overwritten).
        """
        recipe_file = self.path / self.RECIPE
        if recipe_file.exists():
            trained = self.trained()
            if trained:
                raise FileExistsError(
                    f"{recipe_file} already exists and the run trained ({', '.join(trained)}): refusing to overwrite "
                    "another run's recipe; resume it with --resume or choose a new run.output_dir"
                )
            warnings.warn(
                f"{self.path} holds the recipe of a start that never trained (no checkpoint, no metrics): reusing it",
                UserWarning,
                stacklevel=2,
            )
        self.path.mkdir(parents=True, exist_ok=True)
        recipe_file.write_text(yaml.safe_dump(config, sort_keys=False))
        versions = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "packages": {name: _version(name) for name in _PACKAGES},
            "plugins": [
                {"name": p.name, "distribution": p.distribution, "version": p.version, "status": p.status}
                for p in plugins
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
            records = _read_jsonl_repairing_tail(path)
            kept = [r for r in records if r.get("step", 0) <= step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            if name == self.METRICS:
                for record in kept:
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
