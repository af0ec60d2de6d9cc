"""Reward-hacking alarm: the optimised reward keeps rising while a second judge falls or the images drift.

Recipe section ``eval.alarm`` (needs an ``eval`` section; off unless ``enabled``)::

    eval:
      judges: [{class_path: digit-judge}]
      alarm: {enabled: true, window: 3, reward_rise: 0.0, judge_drop: 0.1, stat_drift: 0.08, stop: false}

At every held-out evaluation :class:`RewardHackingAlarm` is fed the evaluation's images and scores
(:meth:`RewardHackingAlarm.observe`), pooled over all evaluation sets (every image of the evaluation, so the
trend is as steady as the evaluation allows). It tracks:

* the **watched rewards**: the evaluation rewards the policy is trained on, scored on the evaluation images (fixed
  prompts and seeds, deterministic sampling: far less noisy than the training batch's reward);
* the **judges** (``eval.judges``): scorers the policy never optimises;
* three **image statistics** on a ``[0, 1]`` scale, averaged over the images: ``brightness`` (mean pixel value),
  ``saturation`` (mean HSV saturation ``(max - min) / max`` of each pixel's RGB) and ``diversity`` (mean absolute
  pixel difference of each image to the mean image of its group: the images sharing its prompt, or the whole set
  when every prompt has one image). A hacked policy typically brightens, saturates or collapses its images.

The rule, evaluated at each evaluation ``t`` once ``window`` evaluations exist (``window`` includes ``t``):

1. **Reward rising**: for some watched reward, the least-squares line through its last ``window`` evaluation means
   (against the step) rises by more than ``reward_rise`` across the window, and the current mean is above the
   baseline (the first evaluation, normally step 0).
2. **and a judge falling**: some judge is more than ``judge_drop`` below its best mean so far and its own
   least-squares change over the window is negative (it is falling now, not merely lower than a lucky peak);
3. **or a statistic drifting**: some statistic differs from its baseline value by more than ``stat_drift``.

When 1 and (2 or 3) hold, the alarm is *active* at ``t``; the first time it is active the alarm *fires* (it stays
fired: ``alarm/fired`` is latched) and a warning names the reward, the judge or statistic and the numbers. With
``stop: true`` the runner ends the run after that evaluation (a checkpoint is saved, the run's status is
``stopped``). The thresholds are absolute: judges are probabilities on the digits world and the statistics are on
``[0, 1]``, so ``judge_drop: 0.1`` is ten percentage points and ``stat_drift: 0.08`` is 8 % of the pixel range. The
defaults, and the evidence that they fire on a planted hack and stay silent on the README main job, are in
``docs/benchmarks.md`` ("Reward-hacking alarm"). The detector restarts with an empty history when a run resumes.

:func:`rlpost.apps.alarm_replay.replay` runs the same detector over a finished run directory (its ``eval.jsonl``
per-prompt scores and the per-image PNGs of ``eval.save_images: true``, which hold the exact uint8 images), e.g. with
other thresholds::

    python -m rlpost.apps.alarm_replay RUN_DIR [RUN_DIR ...] [--window 3] [--judge-drop 0.1] [--stat-drift 0.08]
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["STATS", "AlarmConfig", "RewardHackingAlarm", "image_stats", "ls_change"]

STATS = ("brightness", "saturation", "diversity")
"""The image statistics the alarm tracks (:func:`image_stats`)."""

log = logging.getLogger(__name__)


@dataclass
class AlarmConfig:
    """Recipe section ``eval.alarm``.

    Attributes:
        enabled: Run the detector at every evaluation.
        window: Evaluations in the trend window, the current one included (>= 2).
        reward_rise: A watched reward counts as rising when its least-squares change across the window exceeds this
            (>= 0; in the reward's units).
        judge_drop: A judge counts as falling when it is more than this below its best so far and its least-squares
            change across the window is negative (> 0; in the judge's units).
        stat_drift: An image statistic counts as drifted when it is more than this away from its baseline (> 0; the
            statistics are on ``[0, 1]``).
        stop: End the run after the evaluation at which the alarm fires.
    """

    enabled: bool = False
    window: int = 3
    reward_rise: float = 0.0
    judge_drop: float = 0.1
    stat_drift: float = 0.08
    stop: bool = False

    def problems(self) -> list[str]:
        """Range problems, each naming its ``eval.alarm.*`` field."""
        out = []
        if self.window < 2:
            out.append(f"eval.alarm.window: must be >= 2 (a trend needs two evaluations), got {self.window}")
        if not (math.isfinite(self.reward_rise) and self.reward_rise >= 0):
            out.append(f"eval.alarm.reward_rise: must be a finite number >= 0, got {self.reward_rise}")
        for name in ("judge_drop", "stat_drift"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                out.append(f"eval.alarm.{name}: must be a finite number > 0, got {value}")
        return out


def image_stats(images: Tensor, groups: Sequence[Any] | None = None) -> dict[str, Tensor]:
    """Per-image statistics on ``[0, 1]`` of ``[N, H, W, 3]`` uint8 images.

    Args:
        images: The images.
        groups: A group label per image (e.g. its prompt); the diversity of an image is its mean absolute pixel
            difference to its group's mean image. ``None``, or no label occurring twice: one group of all images.

    Returns:
        ``{"brightness", "saturation", "diversity"}``: ``[N]`` float64 tensors.
    """
    x = images.double() / 255.0
    hi = x.amax(-1)
    lo = x.amin(-1)
    saturation = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), torch.zeros_like(hi)).mean((1, 2))
    labels = list(groups) if groups is not None else [0] * x.shape[0]
    if len(labels) != x.shape[0]:
        raise ValueError(f"image_stats: {x.shape[0]} images but {len(labels)} group labels")
    if len(set(labels)) == len(labels):  # every prompt once: the diversity of the set as a whole
        labels = [0] * len(labels)
    index = {g: i for i, g in enumerate(dict.fromkeys(labels))}
    gid = torch.tensor([index[g] for g in labels])
    sums = torch.zeros(len(index), *x.shape[1:], dtype=x.dtype).index_add_(0, gid, x)
    counts = torch.bincount(gid, minlength=len(index)).to(x.dtype).view(-1, 1, 1, 1)
    diversity = (x - (sums / counts)[gid]).abs().mean((1, 2, 3))
    return {"brightness": x.mean((1, 2, 3)), "saturation": saturation, "diversity": diversity}


def ls_change(steps: Sequence[float], values: Sequence[float]) -> float:
    """Change across ``steps`` of the least-squares line through ``(steps, values)``: slope x (last - first step)."""
    t = torch.tensor(steps, dtype=torch.float64)
    v = torch.tensor(values, dtype=torch.float64)
    dt = t - t.mean()
    denom = float((dt * dt).sum())
    if denom == 0.0:
        return 0.0
    return float((dt * (v - v.mean())).sum()) / denom * float(t[-1] - t[0])


@dataclass
class _Point:
    step: int
    rewards: dict[str, float]
    judges: dict[str, float]
    stats: dict[str, float]


@dataclass
class RewardHackingAlarm:
    """The detector: feed it each evaluation with :meth:`observe`; it returns the evaluation's alarm record.

    Args:
        config: The ``eval.alarm`` settings.
        watched: Names of the evaluation rewards the policy is trained on.
        judges: Names of the second judges.
    """

    config: AlarmConfig
    watched: list[str]
    judges: list[str] = field(default_factory=list)
    history: list[_Point] = field(default_factory=list)
    fired_step: int | None = None

    @property
    def fired(self) -> bool:
        """Whether the alarm has fired at any evaluation so far."""
        return self.fired_step is not None

    @property
    def stop_requested(self) -> bool:
        """Fired, and ``stop`` is set: the run should end."""
        return self.fired and self.config.stop

    def observe(
        self,
        step: int,
        scores: Mapping[str, Sequence[float]],
        images: Tensor,
        groups: Sequence[Any] | None = None,
    ) -> dict[str, Any]:
        """Add one evaluation and apply the rule.

        Args:
            step: The training step of the evaluation.
            scores: Per-image scores by scorer name (watched rewards and judges; other names are ignored), pooled
                over the evaluation sets.
            images: The evaluation's ``[N, H, W, 3]`` uint8 images, aligned with ``scores``.
            groups: A group label per image for the diversity statistic (see :func:`image_stats`).

        Returns:
            ``{"step", "active", "fired", "fired_step", "reasons", "reward_change", "judge_drop", "stats",
            "stat_drift"}`` (JSON-ready): the rule's inputs at this evaluation and whether it holds.
        """
        stats = {k: float(v.mean()) for k, v in image_stats(images, groups).items()}
        point = _Point(
            step=int(step),
            rewards={k: _mean(scores[k]) for k in self.watched if k in scores},
            judges={k: _mean(scores[k]) for k in self.judges if k in scores},
            stats=stats,
        )
        self.history.append(point)
        return self._judge(point)

    def _judge(self, now: _Point) -> dict[str, Any]:
        c = self.config
        base = self.history[0]
        recent = self.history[-c.window :]
        steps = [float(p.step) for p in recent]
        full = len(recent) >= c.window
        reasons: list[str] = []
        reward_change = {k: ls_change(steps, [p.rewards[k] for p in recent]) for k in now.rewards}
        rising = [
            k
            for k, change in reward_change.items()
            if full and change > c.reward_rise and now.rewards[k] > base.rewards.get(k, math.inf)
        ]
        judge_drop: dict[str, float] = {}
        falling: list[str] = []
        for k, value in now.judges.items():
            best = max(p.judges[k] for p in self.history if k in p.judges)
            judge_drop[k] = best - value
            trend = ls_change(steps, [p.judges[k] for p in recent])
            if full and judge_drop[k] > c.judge_drop and trend < 0:
                falling.append(k)
        stat_drift = {k: now.stats[k] - base.stats[k] for k in now.stats}
        drifted = [k for k, d in stat_drift.items() if full and abs(d) > c.stat_drift]
        active = bool(rising) and bool(falling or drifted)
        if active:
            rise = ", ".join(f"{k} {reward_change[k]:+.3f} over the last {c.window} evaluations" for k in rising)
            for k in falling:
                reasons.append(f"{rise} while judge {k} fell {judge_drop[k]:.3f} below its best")
            for k in drifted:
                reasons.append(f"{rise} while image {k} drifted {stat_drift[k]:+.3f} from step {base.step}")
            if self.fired_step is None:
                self.fired_step = now.step
                log.warning("reward-hacking alarm at step %d: %s", now.step, "; ".join(reasons))
        return {
            "step": now.step,
            "active": active,
            "fired": self.fired,
            "fired_step": self.fired_step,
            "reasons": reasons,
            "reward_change": reward_change,
            "judge_drop": judge_drop,
            "stats": now.stats,
            "stat_drift": stat_drift,
        }

    @staticmethod
    def metrics(record: Mapping[str, Any]) -> dict[str, float]:
        """Flat ``alarm/*`` metrics of an :meth:`observe` record (for the trackers and the progress line)."""
        out = {"alarm/active": float(record["active"]), "alarm/fired": float(record["fired"])}
        if record["fired_step"] is not None:
            out["alarm/fired_step"] = float(record["fired_step"])
        out |= {f"alarm/reward_change/{k}": float(v) for k, v in record["reward_change"].items()}
        out |= {f"alarm/judge_drop/{k}": float(v) for k, v in record["judge_drop"].items()}
        out |= {f"alarm/stat/{k}": float(v) for k, v in record["stats"].items()}
        out |= {f"alarm/stat_drift/{k}": float(v) for k, v in record["stat_drift"].items()}
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(float(v) for v in values) / max(1, len(values))
