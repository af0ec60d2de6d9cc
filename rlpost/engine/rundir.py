"""The run directory: resolved recipe, versions, metrics JSONL and end-of-run summary.

What a run directory must never lose is its record of completed training steps: checkpoints, metric lines, evaluation
lines of steps >= 1, sample grids, a summary or resume record of steps >= 1 (:meth:`RunDirectory.trained`). A new run
refuses a directory holding any of it; anything else is what a start leaves before its first step completes (recipe
and versions, the "before" evaluation at step 0, a summary of 0 steps), also after a ``kill -9`` that ran no cleanup,
and a new run reuses it. ``--resume latest`` continues from the newest checkpoint; in a directory that has none it
restarts the run from step 0 (:meth:`RunDirectory.check_restart`), dropping the lines it logged (the restart logs
them again), unless the run finished: a completed run is never overwritten. A resume from a checkpoint
(:meth:`RunDirectory.reopen`) keeps the stored recipe, drops metric lines logged after the checkpoint it continues
from, and records itself in ``resumes.jsonl``. The rules for users are in ``docs/checkpoints.md``.

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
from rlpost.core.yaml_limits import SAVED_LIMITS, load_yaml
from rlpost.engine.checkpoint import CHECKPOINT_DIR, MANIFEST, CheckpointError, list_checkpoints

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


def _max_step(path: Path, lines: bool) -> float:
    """The largest ``step`` a JSONL file (``lines``) or a JSON object file records: -1 when the file is absent or
    empty, ``inf`` when a record is unreadable (a damaged record is kept, never guessed away). A torn last line (an
    append that never finished) records no completed work and is skipped."""
    if not path.is_file():
        return -1
    try:
        text = path.read_text(encoding="utf-8")
        if not lines:
            return float(json.loads(text)["steps"]) if text.strip() else -1
        records = [ln for ln in text.splitlines() if ln.strip()]
        steps: list[float] = [-1]
        for i, line in enumerate(records):
            try:
                steps.append(float(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                if i < len(records) - 1:
                    raise
        return max(steps)
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf


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

    def checkpoint_dirs(self) -> list[Path]:
        """Every ``checkpoints/step_N`` directory, complete or not (a save in progress is hidden, ``.step_N.tmp-*``)."""
        root = self.path / CHECKPOINT_DIR
        return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")) if root.is_dir() else []

    def trained(self) -> list[str]:
        """What in this directory records completed training steps (empty when no step ever completed here).

        Checkpoints (also one without a readable manifest: a damaged checkpoint is not guessed away), metric lines,
        evaluation lines of steps >= 1, sample grids, and a summary or resume record of steps >= 1 count. The recipe,
        the versions, the "before" evaluation at step 0 and a summary of 0 steps, which a start writes before its
        first step completes (and a rerun writes again), do not.
        """
        found = []
        checkpoints = self.checkpoint_dirs()
        if checkpoints:
            more = f" and {len(checkpoints) - 1} more" if len(checkpoints) > 1 else ""
            found.append(f"{CHECKPOINT_DIR}/{checkpoints[-1].name}{more}")
        metrics = self.path / self.METRICS
        if metrics.is_file() and metrics.stat().st_size > 0:
            found.append(self.METRICS)
        for name in ("eval.jsonl", "resumes.jsonl"):
            if _max_step(self.path / name, lines=True) >= 1:
                found.append(name)
        if _max_step(self.path / self.SUMMARY, lines=False) >= 1:
            found.append(self.SUMMARY)
        grids = self.path / "grids"
        if grids.is_dir() and any(grids.iterdir()):
            found.append("grids/")
        return found

    def finished(self) -> str | None:
        """``"completed"`` or ``"stopped"`` when ``summary.json`` says the run ended so; ``None`` otherwise (no
        summary, a failed or interrupted run, or one killed before it could write one)."""
        try:
            status = json.loads((self.path / self.SUMMARY).read_text(encoding="utf-8")).get("status")
        except (OSError, ValueError, AttributeError):
            return None
        return status if status in ("completed", "stopped") else None

    def _refusal(self, trained: list[str]) -> str:
        """Why a new run may not start here, and what the user can do instead."""
        status = self.finished()
        if list_checkpoints(self.path):
            instead = "continue it with --resume latest"
        elif self.checkpoint_dirs():
            instead = f"its checkpoints lack a readable {MANIFEST} (damaged): repair or remove them"
        elif status is not None:
            instead = f"it {status} without saving a checkpoint, so nothing can resume it"
        else:
            instead = (
                "it saved no checkpoint: --resume latest starts it again from step 0 (dropping the steps it logged)"
            )
        return (
            f"{self.path} holds a run that trained ({', '.join(trained)}): refusing to overwrite it; {instead}, "
            "or choose a new run.output_dir"
        )

    def check_restart(self) -> None:
        """Check that ``--resume latest`` may restart this run from step 0 (called when it holds no complete
        checkpoint): it holds a run's ``recipe.yaml``, no damaged checkpoint, and the run did not finish.

        Raises:
            CheckpointError: Naming why not, and what to do instead.
        """
        if not (self.path / self.RECIPE).is_file():
            raise CheckpointError(
                f"--resume latest: {self.path} holds no run to resume (no {self.RECIPE}): start it without --resume"
            )
        damaged = self.checkpoint_dirs()
        if damaged:
            names = ", ".join(d.name for d in damaged[:3]) + (" ..." if len(damaged) > 3 else "")
            raise CheckpointError(
                f"--resume latest: no complete checkpoint in {self.path / CHECKPOINT_DIR}: {names} lack a readable "
                f"{MANIFEST} (damaged); repair them, or remove them to start the run again from step 0"
            )
        status = self.finished()
        if status is not None:
            raise CheckpointError(
                f"--resume latest: {self.path} holds a run that {status} without saving a checkpoint: nothing to "
                "resume from; choose a new run.output_dir"
            )

    def create(self, config: dict[str, Any], plugins: Sequence[PluginInfo], restart: bool = False) -> bool:
        """Create the directory and write the resolved recipe and versions (``plugins``: every plugin the host knows,
        built-ins included, as ``PluginHost.plugins(include_builtin=True)`` lists them).

        A directory that records no completed step (:meth:`trained` finds nothing: a start that failed or was killed
        before its first step) is reused with a warning, so a retry needs no new ``run.output_dir``. ``restart``
        (``--resume latest`` where :meth:`check_restart` passed) also reuses one whose steps are recorded only in
        logs: they are dropped, and ``resumes.jsonl`` notes the restart. Either way the earlier attempt's metric and
        evaluation lines and its summary are cleared: the run logs them again.

        Returns:
            Whether an earlier attempt had written here (the trackers then hide what it logged).

        Raises:
            FileExistsError: Without ``restart``, the directory holds a run that trained (never overwritten); the
                message says how to continue it.
            CheckpointError: The directory or a file in it cannot be written (names the path and the OS error).
        """
        recipe_file = self.path / self.RECIPE
        trained = self.trained()
        if trained and not restart:
            raise FileExistsError(self._refusal(trained))
        earlier = recipe_file.exists()
        if earlier:
            what = (
                f"restarting the run from step 0 and dropping what it logged ({', '.join(trained)})"
                if trained
                else "reusing the files of a start that never completed a step"
            )
            warnings.warn(f"{self.path}: {what}", UserWarning, stacklevel=2)
        versions = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "packages": {name: _version(name) for name in _PACKAGES},
            "plugins": [
                {"name": p.name, "distribution": p.distribution, "version": p.version, "status": p.status}
                for p in plugins
            ],
        }
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if earlier:
                for name in (self.METRICS, "eval.jsonl", "eval.md", self.SUMMARY):
                    (self.path / name).unlink(missing_ok=True)
            recipe_file.write_text(yaml.safe_dump(config, sort_keys=False))
            (self.path / self.VERSIONS).write_text(json.dumps(versions, indent=2))
            if restart:
                with (self.path / "resumes.jsonl").open("a") as fh:
                    fh.write(json.dumps({"step": 0, "checkpoint": None, "restart": True}) + "\n")
        except OSError as exc:
            raise CheckpointError(f"run.output_dir {self.path}: cannot write the run directory ({exc})") from None
        return earlier

    def stored_recipe(self) -> dict[str, Any]:
        """The resolved recipe written when the run started (read with the limits of
        :func:`rlpost.core.yaml_limits.load_yaml`, ``SAVED_LIMITS``: the saved file lists every default).

        Raises:
            CheckpointError: The run directory does not exist, holds no ``recipe.yaml``, or it is not a YAML mapping;
                each names the path.
        """
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "does not exist"
            raise CheckpointError(f"run directory {self.path} {what}")
        recipe_file = self.path / self.RECIPE
        if not recipe_file.is_file():
            raise CheckpointError(
                f"{recipe_file} not found: {self.path} is not a run directory (a run writes its {self.RECIPE} when it "
                "starts)"
            )
        try:
            data = load_yaml(recipe_file.read_text(encoding="utf-8"), str(recipe_file), SAVED_LIMITS)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise CheckpointError(f"{recipe_file}: not a readable YAML recipe ({' '.join(str(exc).split())})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{recipe_file}: not a recipe (expected a YAML mapping, got {type(data).__name__})")
        return data

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
