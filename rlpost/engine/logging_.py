"""Metric sinks: ``metrics.jsonl`` always; the experiment trackers of ``logging.report_to`` (TensorBoard, W&B,
MLflow, ... through Hugging Face accelerate's tracker layer, :mod:`rlpost.engine.trackers`).

Optional trackers are imported only when listed, and a recipe listing one whose package is missing is rejected by
validation (:func:`missing_tracker_packages`) before any model loads. Only the main process constructs a logger.
Keys are namespaced: ``reward/<source>``, ``adv/*``, ``loss/*``, ``kl/*``, ``train/*``, ``guard/*``, ``perf/*``,
``eval/*``.

Besides the scalars, the trackers get the resolved recipe (TensorBoard as text, W&B as its config, the others as
hyperparameters), every saved sample grid as an image (:meth:`MetricsLogger.log_image`), a video model's samples as
video (:meth:`MetricsLogger.log_video`) and, in TensorBoard when the logger closes, an HParams-dashboard session: the
recipe's scalar settings as hyperparameters and the ``reward/*`` and ``eval/*`` series as its metrics (the dashboard
shows each series' last value: the run's final metrics). A resumed run's TensorBoard writer purges the events an
interrupted run wrote after the checkpoint it resumed from, as ``metrics.jsonl`` is truncated, so no step appears
twice; its W&B run is the same W&B run (the id is kept in the run directory).

The booleans ``logging.tensorboard`` / ``logging.wandb`` and ``logging.wandb_project`` of earlier releases still work
as deprecated aliases of ``report_to`` and ``project`` (with a ``FutureWarning``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rlpost.engine.rundir import RunDirectory
from rlpost.engine.trackers import (
    flat_hparams,
    known_trackers,
    log_images,
    log_videos,
    start_trackers,
    tracker_problem,
)

__all__ = ["LoggingConfig", "MetricsLogger", "flat_hparams", "missing_tracker_packages"]


@dataclass
class LoggingConfig:
    """Recipe section ``logging``.

    Attributes:
        report_to: Experiment trackers, by Hugging Face accelerate's names: ``tensorboard`` (event files in
            ``<run>/tensorboard``), ``wandb``, ``mlflow``, ``comet_ml``, ``aim``, ``clearml``, ``dvclive``,
            ``swanlab``, ``trackio``; each needs its package (``pip install 'rlpost[wandb]'``) and honours its own
            environment variables (``WANDB_MODE``, ``MLFLOW_TRACKING_URI``, ...).
        project: The project the run is filed under (W&B project, MLflow experiment, ...).
        init_kwargs: Keyword arguments per tracker for its constructor (``{wandb: {entity: me, tags: [a]}}``).
        grid_every: Save a captioned PNG grid of the step's samples to ``<run>/grids`` every N steps (0 = never); a
            video model's samples also as an animated GIF grid, logged to the trackers as video.
        tensorboard: Deprecated: use ``report_to: [tensorboard]``.
        wandb: Deprecated: use ``report_to: [wandb]``.
        wandb_project: Deprecated: use ``project``.
    """

    report_to: list[str] = field(default_factory=list)
    project: str = "rlpost"
    init_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    grid_every: int = 0
    tensorboard: bool | None = None
    wandb: bool | None = None
    wandb_project: str | None = None

    DEPRECATED: ClassVar[dict[str, str]] = {
        "tensorboard": "report_to: [tensorboard]",
        "wandb": "report_to: [wandb]",
        "wandb_project": "project",
    }
    """Deprecated field -> what replaces it; left out of the resolved recipe once folded in."""

    def __post_init__(self) -> None:
        """Fold the deprecated fields into ``report_to`` and ``project``, warning once per field."""
        for flag in ("tensorboard", "wandb"):
            value = getattr(self, flag)
            if value is None:
                continue
            _deprecated(f"logging.{flag}", f"logging.report_to: [{flag}]")
            if value and flag not in self.report_to:
                self.report_to = [*self.report_to, flag]
            setattr(self, flag, None)
        if self.wandb_project is not None:
            _deprecated("logging.wandb_project", "logging.project")
            if self.project == "rlpost":
                self.project, self.wandb_project = self.wandb_project, None

    def problems(self) -> list[str]:
        """Range problems, unknown trackers and listed trackers whose package is not installed, each naming its
        field relative to the section (the recipe prefixes ``logging.``)."""
        problems = [f"grid_every: must be >= 0, got {self.grid_every}"] if self.grid_every < 0 else []
        if self.wandb_project is not None:
            problems.append(f"wandb_project: the deprecated name of project; give only project ({self.project!r})")
        unknown = sorted(set(self.init_kwargs) - set(known_trackers()))
        if unknown:
            problems.append(f"init_kwargs: unknown tracker(s) {unknown}; choose from {', '.join(known_trackers())}")
        return problems + self.missing_trackers()

    def missing_trackers(self) -> list[str]:
        """Listed trackers that are unknown or whose package is not installed, each naming its field relative to
        the section."""
        return [f"report_to[{i}]: {p}" for i, name in enumerate(self.report_to) if (p := tracker_problem(name))]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", FutureWarning, stacklevel=4)


def missing_tracker_packages(config: LoggingConfig) -> list[str]:
    """Problems for listed trackers that are unknown or whose package is not installed, each naming its
    ``logging.*`` field."""
    return [f"logging.{p}" for p in config.missing_trackers()]


class MetricsLogger:
    """Writes every logged step to ``metrics.jsonl`` and each tracker of ``logging.report_to``.

    Args:
        rundir: The run directory (``metrics.jsonl``).
        config: Which trackers to use.
        run_name: Name of the run in the trackers.
        recipe: Resolved recipe, stored as the trackers' configuration.
        resume_step: The step of the checkpoint a resumed run continues from: TensorBoard hides the events an
            earlier process logged after it (``SummaryWriter(purge_step=...)``) and W&B continues the stored run;
            ``-1`` for a restart of this directory from step 0, ``None`` for a new run.
    """

    def __init__(
        self,
        rundir: RunDirectory,
        config: LoggingConfig,
        run_name: str,
        recipe: dict[str, Any],
        resume_step: int | None = None,
    ) -> None:
        self.rundir = rundir
        problems = missing_tracker_packages(config)
        if problems:
            raise RuntimeError("; ".join(problems))
        kwargs = {name: dict(value) for name, value in config.init_kwargs.items()}
        if "wandb" in config.report_to:
            kwargs.setdefault("wandb", {}).setdefault("name", run_name)
        self.trackers = start_trackers(config.report_to, rundir.path, config.project, recipe, kwargs, resume_step)

    def tracker(self, name: str) -> Any:
        """The started tracker called ``name`` (accelerate's ``GeneralTracker``), or ``None``."""
        return next((t for t in self.trackers if t.name == name), None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log one step's metrics everywhere."""
        self.rundir.log_metrics(step, metrics)
        self.log_trackers(step, metrics)

    def log_trackers(self, step: int, metrics: dict[str, float]) -> None:
        """Log to the trackers only (held-out ``eval/*`` metrics, which have their own ``eval.jsonl``)."""
        for tracker in self.trackers:
            tracker.log(dict(metrics), step=step)

    def log_image(self, step: int, tag: str, path: Path) -> None:
        """Log a saved PNG (a captioned sample grid) to the trackers, exactly as written to disk."""
        log_images(self.trackers, step, tag, path)

    def log_video(self, step: int, tag: str, path: Path) -> None:
        """Log a saved animated GIF (a video grid) to TensorBoard and W&B as video."""
        log_videos(self.trackers, step, tag, path)

    def close(self) -> None:
        """Flush and close the trackers (TensorBoard writes its HParams session first)."""
        for tracker in self.trackers:
            tracker.finish()
