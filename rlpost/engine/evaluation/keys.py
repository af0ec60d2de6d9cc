"""Names of the held-out evaluation's outputs: metric keys, set names, image directories and the stash key.

Metric names (:func:`metric_key`): ``eval/<reward>`` and ``eval/judge/<judge>`` for a single ``eval.prompts`` source;
``eval/<set>/<reward>`` and ``eval/<set>/judge/<judge>`` with ``eval.sets``. Readers of finished runs
(:mod:`rlpost.apps.reporting`, :mod:`rlpost.apps.alarm_replay`) use the same functions, so a name is spelt in one
place.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlpost.core.contract import StashKey

__all__ = ["JUDGE", "LAST_EVAL", "SET_NAME_RE", "image_dir", "metric_key", "set_field"]

JUDGE = "judge"
"""Marks a second judge's metric (``eval/<set>/judge/<name>``) and per-prompt score (``judge/<name>``)."""
LAST_EVAL: StashKey[dict[str, float]] = StashKey("rlpost.last_eval")
"""The latest evaluation's metrics in the run's stash (set by :func:`rlpost.engine.evaluation.run`; the progress
line shows the alarm)."""
SET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""Allowed evaluation set names (they become metric path segments and directory names)."""


def metric_key(set_name: str, scorer: str, judge: bool = False) -> str:
    """``eval/[<set>/][judge/]<scorer>``; ``set_name`` is ``""`` for a single unnamed ``eval.prompts`` source."""
    return "/".join(["eval", *([set_name] if set_name else []), *([JUDGE] if judge else []), scorer])


def image_dir(output_dir: Path, set_name: str, step: int) -> Path:
    """Where one evaluation's per-image PNGs go: ``eval/step_N`` or, for a named set, ``eval/<set>/step_N``."""
    base = output_dir / "eval"
    return (base / set_name if set_name else base) / f"step_{step:06d}"


def set_field(set_name: str) -> str:
    """The recipe field of an evaluation set: ``eval.sets.<name>``, or ``eval.prompts`` for the unnamed one."""
    return f"eval.sets.{set_name}" if set_name else "eval.prompts"
