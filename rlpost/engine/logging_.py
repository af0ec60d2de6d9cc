"""Metric sinks: ``metrics.jsonl`` always; TensorBoard and Weights & Biases when the recipe enables them.

Optional trackers are imported only when enabled, and a recipe enabling one whose package is missing is rejected by
validation (:func:`missing_tracker_packages`) before any model loads. Only the main process constructs a logger.
Keys are namespaced: ``reward/<source>``, ``adv/*``, ``loss/*``, ``kl/*``, ``train/*``, ``guard/*``, ``perf/*``,
``eval/*``.

Besides the scalars, TensorBoard gets the resolved recipe as text (tag ``recipe``), every saved sample grid as an image
(:meth:`MetricsLogger.log_image`) and, when the logger closes, an HParams-dashboard session: the recipe's scalar
settings as hyperparameters and the ``reward/*`` and ``eval/*`` series as its metrics (the dashboard shows each series'
last value: the run's final metrics). A resumed run's writer purges the events an interrupted run wrote after the
checkpoint it resumed from, as ``metrics.jsonl`` is truncated, so no step appears twice.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from rlpost.engine.rundir import RunDirectory

__all__ = ["LoggingConfig", "MetricsLogger", "flat_hparams", "missing_tracker_packages"]

# Metric series the HParams dashboard compares runs by (the rest are diagnostics with their own scalar charts).
HPARAM_METRIC_PREFIXES = ("reward/", "eval/")
MAX_HPARAM_LIST = 8


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
        """Range problems and enabled trackers whose package is not installed, each naming its field relative to the
        section (the recipe prefixes ``logging.``)."""
        problems = [f"grid_every: must be >= 0, got {self.grid_every}"] if self.grid_every < 0 else []
        return problems + self.missing_trackers()

    def missing_trackers(self) -> list[str]:
        """Enabled trackers whose package is not installed, each naming its field relative to the section."""
        return [
            f"{flag}: enabled but the {package!r} package is not installed (pip install {package})"
            for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb"))
            if getattr(self, flag) and importlib.util.find_spec(package) is None
        ]


def missing_tracker_packages(config: LoggingConfig) -> list[str]:
    """Problems for enabled trackers whose package is not installed, each naming its ``logging.*`` field."""
    return [f"logging.{p}" for p in config.missing_trackers()]


class MetricsLogger:
    """Writes every logged step to each enabled sink.

    Args:
        rundir: The run directory (``metrics.jsonl``).
        config: Which optional trackers to use.
        run_name: Name shown in W&B.
        recipe: Resolved recipe, stored as the W&B config.
        resume_step: The step of the checkpoint a resumed run continues from: TensorBoard hides the events an
            earlier process logged after it (``SummaryWriter(purge_step=...)``); ``None`` for a new run.
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
        self._recipe = recipe
        self._metric_keys: list[str] = []  # trackers' metric names, first-seen order (for the HParams session)
        self._tb: Any = None
        self._wandb: Any = None
        problems = missing_tracker_packages(config)
        if problems:
            raise RuntimeError("; ".join(problems))
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Steps are logged after they complete (1, 2, ...): the first one a resumed run logs is resume_step + 1.
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(rundir.path / "tensorboard"), purge_step=purge)
            # Indented four spaces: TensorBoard's text plugin renders markdown, and this keeps the YAML verbatim.
            text = yaml.safe_dump(recipe, sort_keys=False)
            self._tb.add_text("recipe", "\n".join("    " + line for line in text.splitlines()), 0)
        if config.wandb:
            import wandb

            self._wandb = wandb.init(project=config.wandb_project, name=run_name, config=recipe, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log one step's metrics everywhere."""
        self.rundir.log_metrics(step, metrics)
        self.log_trackers(step, metrics)

    def log_trackers(self, step: int, metrics: dict[str, float]) -> None:
        """Log to TensorBoard/W&B only (held-out ``eval/*`` metrics, which have their own ``eval.jsonl``)."""
        known = set(self._metric_keys)
        self._metric_keys.extend(k for k in metrics if k not in known)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def log_image(self, step: int, tag: str, path: Path) -> None:
        """Log a saved PNG (a captioned sample grid) to TensorBoard and W&B, exactly as written to disk."""
        if self._tb is not None:
            with Image.open(path) as img:
                pixels = np.asarray(img.convert("RGB"))
            self._tb.add_image(tag, pixels, step, dataformats="HWC")
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        """Write the HParams session (TensorBoard), then flush and close the trackers."""
        if self._tb is not None:
            self._write_hparams()
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def _write_hparams(self) -> None:
        """One HParams session in the run's own event files, so its metrics are the scalar series already logged.

        ``SummaryWriter.add_hparams`` would write a separate run in a sub-directory with one copied value per metric;
        writing the plugin's summaries here instead links the dashboard to the full ``reward/*``/``eval/*`` curves.
        """
        metrics = [k for k in self._metric_keys if k.startswith(HPARAM_METRIC_PREFIXES)]
        writer = self._tb._get_file_writer()  # SummaryWriter has no public add_summary; add_hparams uses this too
        for summary in _hparams_summaries(flat_hparams(self._recipe), metrics):
            writer.add_summary(summary)


def flat_hparams(recipe: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The recipe's scalar settings under dotted keys (``torch_optimizer.init_args.lr``, ``rewards.0.class_path``).

    Lists are indexed, and one longer than :data:`MAX_HPARAM_LIST` becomes the string ``"[N items]"``; ``None`` and
    non-finite floats are left out (the HParams plugin cannot store them).
    """
    flat: dict[str, bool | int | float | str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)) and len(value) > MAX_HPARAM_LIST:
            flat[prefix] = f"[{len(value)} items]"  # a prompt list is data, not thousands of hyperparameters
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        elif isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
            flat[prefix] = value

    walk("", recipe)
    return flat


def _hparams_summaries(hparams: dict[str, bool | int | float | str], metric_keys: list[str]) -> list[Any]:
    """The HParams plugin's experiment, session-start and session-end summaries for one run."""
    from torch.utils.tensorboard import summary

    make: Any = summary.hparams  # untyped in torch
    # The metric values are unused here: the dashboard reads the run's scalar series of the same names.
    return list(make(hparams, dict.fromkeys(metric_keys, 0.0)))
