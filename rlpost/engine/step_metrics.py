"""What a training step logs: its metrics (rewards, advantages, update counts, rollout stats, phase times, memory)
and its sample grid. Names and meanings are listed in ``docs/logging.md``."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from rlpost.core.contract import RewardScores, Rollout
from rlpost.engine.logging_ import MetricsLogger
from rlpost.engine.phases import STEP_PHASES, PhaseTimer
from rlpost.engine.ratio_guard import SpeedupCheck
from rlpost.engine.sharding import UpdateTotals
from rlpost.ops.images import save_grid, save_video_grid

__all__ = ["save_step_grid", "step_metrics"]


def step_metrics(
    rollout: Rollout,
    scores: RewardScores,
    adv: dict[str, float],
    update: UpdateTotals | None,
    phases: PhaseTimer,
    ratio_check: SpeedupCheck | None,
) -> dict[str, float]:
    """One step's metrics from the gathered ``rollout`` and ``scores``, the estimator's metrics ``adv``, the update
    (``None`` when the guards skipped it), the phase timer and the speed-up guard's measurement."""
    metrics: dict[str, float] = {}
    for name, values in scores.scores.items():
        metrics[f"reward/{name}"] = float(values.mean())
    metrics["reward/weighted"] = float(scores.weighted_sum().mean())
    metrics.update({k if "/" in k else f"adv/{k}": v for k, v in adv.items()})
    metrics.update(update.metrics() if update is not None else {})
    metrics.update(rollout.stats)
    metrics["perf/images"] = float(rollout.num_samples)
    for phase in STEP_PHASES:  # a skipped phase (no update after a guard trip) took no time
        metrics[f"perf/{phase}_sec"] = phases.current.get(phase, 0.0)
    metrics["perf/step_sec"] = phases.step_elapsed()
    metrics.update(ratio_check.metrics() if ratio_check is not None else {})
    if torch.cuda.is_available():
        metrics["perf/peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    metrics["perf/peak_rss_gb"] = rss / (2**30 if sys.platform == "darwin" else 2**20)
    return metrics


def save_step_grid(
    run_dir: Path, step: int, rollout: Rollout, scores: RewardScores, logger: MetricsLogger | None
) -> None:
    """Write the step's samples as ``grids/step_NNNNNN.png`` captioned with prompt and weighted reward, and log it
    as ``samples/grid``; a video model's samples also as the animated ``grids/step_NNNNNN.gif``, logged as the video
    ``samples/video``."""
    total = scores.weighted_sum()
    captions = [f"{p} | r={float(v):.3g}" for p, v in zip(rollout.sample_prompts, total, strict=True)]
    grid = save_grid(rollout.media, captions, run_dir / "grids" / f"step_{step:06d}.png")
    video = None
    if rollout.media.shape[1] > 1:
        video = save_video_grid(rollout.media, captions, grid.with_suffix(".gif"))
    if logger is not None:
        logger.log_image(step, "samples/grid", grid)
        if video is not None:
            logger.log_video(step, "samples/video", video)
