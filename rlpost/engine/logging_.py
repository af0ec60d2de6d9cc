"""Metric sinks: ``metrics.jsonl`` always; TensorBoard and Weights & Biases when the recipe enables them.

Optional trackers are imported only when enabled, and a recipe enabling one whose package is missing is rejected by
validation (:func:`missing_tracker_packages`) before any model loads. Only the main process constructs a logger.
Keys are namespaced: ``reward/<source>``, ``adv/*``, ``loss/*``, ``kl/*``, ``train/*``, ``guard/*``, ``perf/*``,
``eval/*``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from rlpost.engine.rundir import RunDirectory

__all__ = ["LoggingConfig", "MetricsLogger", "missing_tracker_packages"]


@dataclass
class LoggingConfig:
    """Recipe section ``logging``.

    Attributes:
        tensorboard: Also write TensorBoard event files to ``<run>/tensorboard`` (needs the ``tensorboard`` package).
        wandb: Also log to Weights & Biases (needs ``wandb``; honours the usual ``WANDB_*`` environment variables).
        wandb_project: W&B project name.
        grid_every: Save a captioned PNG grid of the step's samples to ``<run>/grids`` every N steps (0 = never).
    """

    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "rlpost"
    grid_every: int = 0

    def problems(self) -> list[str]:
        """Range problems, each naming its ``logging.*`` field (missing trackers: :func:`missing_tracker_packages`)."""
        return [f"logging.grid_every: must be >= 0, got {self.grid_every}"] if self.grid_every < 0 else []


def missing_tracker_packages(config: LoggingConfig) -> list[str]:
    """Recipe problems for enabled trackers whose package is not installed."""
    problems = []
    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(config, flag) and importlib.util.find_spec(package) is None:
            problems.append(
                f"logging.{flag}: enabled but the {package!r} package is not installed (pip install {package})"
            )
    return problems


class MetricsLogger:
    """Writes every logged step to each enabled sink.

    Args:
        rundir: The run directory (``metrics.jsonl``).
        config: Which optional trackers to use.
        run_name: Name shown in W&B.
        recipe: Resolved recipe, stored as the W&B config.
    """

    def __init__(self, rundir: RunDirectory, config: LoggingConfig, run_name: str, recipe: dict[str, Any]) -> None:
        self.rundir = rundir
        self._tb: Any = None
        self._wandb: Any = None
        problems = missing_tracker_packages(config)
        if problems:
            raise RuntimeError("; ".join(problems))
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(rundir.path / "tensorboard"))
        if config.wandb:
            import wandb

            self._wandb = wandb.init(project=config.wandb_project, name=run_name, config=recipe, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log one step's metrics everywhere."""
        self.rundir.log_metrics(step, metrics)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def log_trackers(self, step: int, metrics: dict[str, float]) -> None:
        """Log to TensorBoard/W&B only (held-out ``eval/*`` metrics, which have their own ``eval.jsonl``)."""
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        """Flush and close the trackers."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
