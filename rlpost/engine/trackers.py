"""The experiment trackers of ``logging.report_to``, on Hugging Face accelerate's tracker layer.

Every name accelerate knows (``tensorboard``, ``wandb``, ``mlflow``, ``comet_ml``, ``aim``, ``clearml``, ``dvclive``,
``swanlab``, ``trackio``, and any tracker registered with ``accelerate.tracking.register_tracker_class``) is a valid
``report_to`` entry. :func:`start_trackers` selects them with accelerate's ``filter_trackers`` and builds and starts
them as ``Accelerator.init_trackers`` does (huggingface/accelerate src/accelerate/accelerator.py@16cb6eb8
L3272-3322: one instance per name from ``LOGGER_TYPE_TO_CLASS``, the logging directory as second argument when the
class requires one, per-tracker ``init_kwargs``, then ``start()`` and ``store_init_configuration``), without
building an ``Accelerator``: rlpost places devices and joins process groups itself, and only its main process
creates trackers, so each tracker's ``main_process_only`` check is turned off. accelerate's ``PartialState``, which
its trackers' logging needs, is built once the process group exists, so it adopts rlpost's.

TensorBoard and W&B are accelerate's own trackers (src/accelerate/tracking.py@16cb6eb8 L179-420) with what a run
directory needs added: TensorBoard writes into ``<run>/tensorboard`` itself and hides an interrupted attempt's events
(``purge_step``), and gets the recipe as text, images, videos (animated GIFs, the summary ``SummaryWriter.add_video``
writes, which needs moviepy 1) and, at ``finish``, an HParams session; W&B continues the run id stored in the run
directory, so a resumed run is the same W&B run, and gets images and videos as ``wandb.Image``/``wandb.Video``.
"""

from __future__ import annotations

import io
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, TensorBoardTracker, WandBTracker
from accelerate.tracking import filter_trackers as accelerate_filter_trackers
from PIL import Image

__all__ = [
    "RunTensorBoard",
    "flat_hparams",
    "RunWandB",
    "known_trackers",
    "log_images",
    "log_videos",
    "start_trackers",
    "tracker_problem",
    "wandb_run_id",
]

HPARAM_METRIC_PREFIXES = ("reward/", "eval/")
"""Metric series the HParams dashboard compares runs by (the rest are diagnostics with their own scalar charts)."""

WANDB_ID_FILE = "wandb_run_id"
"""File in the run directory holding the W&B run id, so ``--resume`` continues the same W&B run."""

# The package each of accelerate's built-in trackers imports, for the install hint of a missing one.
_PACKAGES = {"wandb": "rlpost[wandb]", "tensorboard": "rlpost[tensorboard]"}


MAX_HPARAM_LIST = 8
"""A longer list in the recipe becomes one hyperparameter ``"[N items]"``."""


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


def known_trackers() -> list[str]:
    """Every ``report_to`` name: accelerate's trackers and any registered through its ``register_tracker_class``."""
    return sorted(LOGGER_TYPE_TO_CLASS)


def tracker_problem(name: str) -> str | None:
    """Why ``name`` cannot be a ``report_to`` entry here (unknown, or its package is not installed), or ``None``."""
    if name not in LOGGER_TYPE_TO_CLASS:
        return f"unknown tracker {name!r}; choose from {', '.join(known_trackers())}"
    import accelerate.utils as utils

    available = getattr(utils, f"is_{name}_available", None)  # a registered custom tracker has no check
    if available is not None and not available():
        package = _PACKAGES.get(name, name)
        return f"{name!r}: the {name!r} package is not installed (pip install '{package}')"
    return None


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of the run in ``run_dir``: the stored one when the run continues (``resumed``: a resume or a
    restart of this directory) and one was stored, else a new one, written to ``<run_dir>/wandb_run_id``."""
    path = run_dir / WANDB_ID_FILE
    if resumed and path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored:
            return stored
    run_id = secrets.token_hex(4)  # W&B ids are [a-z0-9]; eight hex digits as wandb.util.generate_id makes
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


def _after_existing_event_files(log_dir: Path) -> None:
    """Wait (at most about a second) until the wall-clock second is later than every event file's in ``log_dir``.

    TensorBoard reads a run's event files in name order, and a name starts with the second it was created in
    (``events.out.tfevents.<seconds>.<host>.<pid>.<counter>``, the counter compared as text). A resumed writer's
    file must sort after the files whose later steps it purges, so it must not share their second.
    """
    seconds = [
        int(p.name.split(".")[3]) for p in log_dir.glob("events.out.tfevents.*") if p.name.split(".")[3].isdigit()
    ]
    newest = max(seconds, default=0)
    while int(time.time()) <= newest:
        time.sleep(0.05)


class RunTensorBoard(TensorBoardTracker):  # type: ignore[misc]  # accelerate is untyped
    """accelerate's TensorBoard tracker writing the run directory's ``tensorboard/`` itself.

    Args:
        run_name: The run's name (unused for the path: accelerate's tracker writes ``<logging_dir>/<run_name>``).
        logging_dir: The event-file directory.
        purge_step: Hide the events an earlier process logged from this step on (``SummaryWriter(purge_step=...)``).
    """

    def __init__(self, run_name: str, logging_dir: str | Path, purge_step: int | None = None) -> None:
        super().__init__(run_name, str(logging_dir), purge_step=purge_step)
        self.metric_keys: list[str] = []  # metric names in first-seen order, for the HParams session
        self.hparams: dict[str, bool | int | float | str] = {}

    def start(self) -> None:
        from torch.utils.tensorboard import FileWriter, SummaryWriter

        self.logging_dir = str(self.logging_dir_param)
        if self.init_kwargs.get("purge_step") is not None:
            _after_existing_event_files(Path(self.logging_dir))
        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)
        # Summaries SummaryWriter has no method for (the HParams session, GIF videos) go through its public
        # ``file_writer`` (a FileWriter): one event file per process, so the purge marker precedes them all.
        raw: FileWriter | None = self.writer.file_writer
        assert raw is not None  # SummaryWriter opens its FileWriter in __init__
        self.raw: FileWriter = raw

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The resolved recipe as text (tag ``recipe``, step 0); its scalar settings become the HParams at finish."""
        self.hparams = flat_hparams(values)
        # Indented four spaces: TensorBoard's text plugin renders markdown, and this keeps the YAML verbatim.
        text = yaml.safe_dump(values, sort_keys=False)
        self.writer.add_text("recipe", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        known = set(self.metric_keys)
        self.metric_keys.extend(k for k in values if k not in known)
        super().log(values, step=step, **kwargs)

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each ``tag -> [H, W, 3]`` uint8 picture as one image."""
        for tag, pixels in values.items():
            self.writer.add_image(tag, pixels, step, dataformats="HWC")

    def log_videos(self, values: dict[str, Path], step: int | None = None) -> None:
        """Each ``tag -> animated GIF`` as TensorBoard's video summary (an image summary holding the GIF)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        for tag, path in values.items():
            data = Path(path).read_bytes()
            with Image.open(io.BytesIO(data)) as gif:
                width, height = gif.size
            image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=data)
            self.raw.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
        self.raw.flush()

    def finish(self) -> None:
        """Write the HParams session, then close the writer."""
        self._write_hparams()
        self.writer.close()

    def _write_hparams(self) -> None:
        """One HParams session in the run's own event directory, so its metrics are the scalar series already logged.

        ``SummaryWriter.add_hparams`` would write a separate run in a sub-directory with one copied value per metric;
        the summaries of the public ``torch.utils.tensorboard.summary.hparams`` written here instead link the
        dashboard to the full ``reward/*``/``eval/*`` curves.
        """
        from torch.utils.tensorboard import summary

        metrics = [k for k in self.metric_keys if k.startswith(HPARAM_METRIC_PREFIXES)]
        make: Any = summary.hparams  # untyped in torch
        # The metric values are unused here: the dashboard reads the run's scalar series of the same names.
        for proto in make(self.hparams, dict.fromkeys(metrics, 0.0)):
            self.raw.add_summary(proto)
        self.raw.flush()


class RunWandB(WandBTracker):  # type: ignore[misc]  # accelerate is untyped
    """accelerate's W&B tracker, logging images and videos from the files the run wrote."""

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import wandb

        self.run.log({tag: wandb.Image(pixels) for tag, pixels in values.items()}, step=step)

    def log_videos(self, values: dict[str, Path], step: int | None = None) -> None:
        import wandb

        self.run.log({tag: wandb.Video(str(path), format="gif") for tag, path in values.items()}, step=step)


_RUN_TRACKERS: dict[str, type[GeneralTracker]] = {"tensorboard": RunTensorBoard, "wandb": RunWandB}


def start_trackers(
    report_to: list[str],
    run_dir: Path,
    project: str,
    recipe: dict[str, Any],
    init_kwargs: dict[str, dict[str, Any]],
    resume_step: int | None,
) -> list[GeneralTracker]:
    """Build, start and configure the trackers of ``report_to`` for the run in ``run_dir``.

    Args:
        report_to: Tracker names (:func:`known_trackers`); each one's package must be installed (validation checks).
        run_dir: The run directory: TensorBoard writes ``tensorboard/`` in it, W&B keeps its run id there.
        project: The project (W&B project, MLflow experiment, ...) the run is filed under.
        recipe: The resolved recipe: W&B's config, the other trackers' hyperparameters (scalars under dotted keys).
        init_kwargs: Per-tracker keyword arguments for its constructor (``{"wandb": {"entity": ...}}``).
        resume_step: The step a resumed run continues from (``-1``: a restart of this directory), ``None`` when new.
    """
    if not report_to:
        return []
    _accelerate_state()
    trackers: list[GeneralTracker] = []
    for name in accelerate_filter_trackers(list(report_to), run_dir / "tensorboard"):
        key = str(name)
        cls = _RUN_TRACKERS.get(key, LOGGER_TYPE_TO_CLASS[key])
        kwargs = dict(init_kwargs.get(key, {}))
        if key == "tensorboard":
            # Steps are logged after they complete (1, 2, ...): the first a resumed run logs is resume_step + 1.
            kwargs.setdefault("purge_step", None if resume_step is None else resume_step + 1)
        if key == "wandb":
            kwargs.setdefault("id", wandb_run_id(run_dir, resume_step is not None))
            kwargs.setdefault("name", run_dir.name)
            kwargs.setdefault("resume", "allow")
            if "WANDB_DIR" not in os.environ:  # W&B's files beside the run's, not in the working directory
                kwargs.setdefault("dir", str(run_dir))
        if cls.requires_logging_directory:
            tracker = cls(project, run_dir / "tensorboard", **kwargs)
        else:
            tracker = cls(project, **kwargs)
        tracker.main_process_only = False  # rlpost's main process alone builds trackers
        trackers.append(tracker)
    for tracker in trackers:
        tracker.start()
    for tracker in trackers:
        tracker.store_init_configuration(recipe if tracker.name in ("tensorboard", "wandb") else flat_hparams(recipe))
    return trackers


def _accelerate_state() -> None:
    """Build accelerate's ``PartialState``, which its trackers' logging needs, after rlpost joined its process group
    (``PartialState`` then adopts the group; it would start one of its own otherwise).

    Raises:
        RuntimeError: A multi-process launch whose process group rlpost did not start (a recipe without the
            ``distributed`` section): ``PartialState`` would wait for the other ranks in a group of its own.
    """
    import torch.distributed as dist
    from accelerate import PartialState

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "logging.report_to: a multi-process launch needs the recipe's distributed section (rlpost joins the "
            "process group before the trackers start)"
        )
    PartialState()


def log_images(trackers: list[GeneralTracker], step: int, tag: str, path: Path) -> None:
    """Log a saved PNG to every tracker that takes images, exactly as written to disk."""
    with Image.open(path) as img:
        pixels = np.asarray(img.convert("RGB"))
    for tracker in trackers:
        if isinstance(tracker, (RunTensorBoard, RunWandB)):
            tracker.log_images({tag: pixels}, step=step)
        elif hasattr(tracker, "log_images"):  # accelerate's other trackers take a list of images per tag
            tracker.log_images({tag: [pixels]}, step=step)


def log_videos(trackers: list[GeneralTracker], step: int, tag: str, path: Path) -> None:
    """Log a saved animated GIF as video to TensorBoard and W&B (accelerate's other trackers have no video call)."""
    for tracker in trackers:
        if isinstance(tracker, (RunTensorBoard, RunWandB)):
            tracker.log_videos({tag: path}, step=step)
